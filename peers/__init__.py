"""Runnable peer processes (bootstrap, stage, trainer, status); thin wrappers over `swarm`."""
