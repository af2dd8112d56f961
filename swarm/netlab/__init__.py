"""Link shaping: real shaping in Linux namespaces, an in-process shaper, and the kernel's counters.

    namespaces  NetLab: one namespace per process, a bridge, tc tbf/netem per link; cleanup_stale
    kernel      what this kernel allows (detect, require), namespace cleanup, running ip and tc
    links       a lab link as shaped: each direction's qdisc, and the delay left to the caller
    signals     SIGTERM/SIGHUP while a lab is up: teardown first, then the signal handed on
    tc          the tc argv lists (shared by NetLab and the Docker entrypoint)
    container   one peer per container: shape its own interface, find the bootstrap peer, health checks
    shaper      TokenBucket: an asyncio rate + delay shaper for the send path (no root needed)
    counters    link byte counters, the machine's and each process's CPU time, sampled during a run
    `python -m swarm.netlab detect|cleanup|shape|identity|bootstrap-maddr|port-open`: see swarm/netlab/__main__.py

This is the bottom of the lab: it imports nothing from swarm outside swarm.netlab, and importing it
does not import hivemind or torch.
"""
