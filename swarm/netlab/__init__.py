"""The slow-network lab: real shaping in Linux namespaces, an in-process shaper, probes, bounds.

    namespaces  NetLab: one namespace per process, a bridge, tc tbf/netem per link; cleanup_stale
    tc          the tc argv lists (shared by NetLab and the Docker entrypoint)
    rates       '100mbit' / '20ms' parsing and formatting
    shaper      TokenBucket: an asyncio rate + delay shaper for the send path (no root needed)
    probe       payload throughput between two hivemind P2P peers, in-process or across namespaces
    bounds      link, compute and pipeline throughput bounds; fraction of the bound achieved
    adaptive    per-boundary compression choice from measured bandwidth, with hysteresis
    `python -m swarm.netlab detect|cleanup|shape|identity|bootstrap-maddr|port-open`: see swarm/netlab/__main__.py

Importing this package does not import hivemind or torch (swarm.lab.probe does, lazily).
"""
