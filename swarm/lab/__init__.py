"""A whole swarm on this machine as separate processes (`python -m swarm lab`), its links shaped
by `swarm.netlab` and probed before the run."""
