"""The swarm on the DHT: stage peers' records, the run's published config and status, and surveys of every peer."""
