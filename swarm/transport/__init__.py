"""The engine's two transports: `local` (every stage in this process) and `hivemind` (stage peers
on hivemind's P2P and DHT). Both drive the same `swarm.engine` stage runtimes and step."""
