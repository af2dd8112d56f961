"""The pipeline engine: stage runtimes that turn incoming messages into outgoing ones, and the
transports that deliver them (in-process here; hivemind in `swarm.swarm` / `peers`)."""
