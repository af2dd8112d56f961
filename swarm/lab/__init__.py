"""A whole swarm on this machine as separate processes (`python -m swarm lab`), its links shaped
by `swarm.netlab` and probed before the run.

    launch            Lab: the bootstrap, stage peers and trainer as processes; run_lab
    plan              RunPlan and LinkPlan: the run's swarm and links, checked before anything starts
    bandwidth         the --bandwidth option: one rate, NAME=RATE pairs or a YAML file
    probe             payload throughput between two hivemind peers (in process, or its command line)
    probe_namespaces  the probe across a lab's namespaces, one subprocess per process
"""
