"""A peer on hivemind's P2P and DHT: its settings, node and event loops, framed calls on pooled streams, retries, what travels with a request, its event log."""
