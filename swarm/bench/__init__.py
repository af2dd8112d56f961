"""Benchmarks that print figures (never timed assertions).

codecs, tensors       `bench codecs`: bits, error and speed of every codec on realistic tensors
streams               `bench streams`: a new hivemind stream per exchange against one kept open
throughput            `bench throughput`: samples/s of a shaped swarm per codec and bandwidth
throughput_figures    one point's row: what it achieved and what bounded it
throughput_table      the rows as a table, speed-ups, target lines, a plot and JSON
bounds, fluid         the link and compute bounds; what the schedule allows on ideal links
fluid_swarm           the fluid model over replicas: per-peer links and compute, routing, micro-batches per replica
scale_model, scale_dht, scale_lab, scale_sweep
                      `bench scale`: the swarm at internet scale, modelled (averaging, churn, DHT load,
                      what saturates), a lab row's prediction, the sweep's rows, table and plot
dht_stores            stores of one key a pair of hivemind DHT nodes takes a second
time_to_target        `bench time-to-target`: training seconds until the evaluation reaches a target
time_to_target_table  its rows as a table, against the targets, a plot and JSON
tiny_decoder          a plain-torch decoder, one block per stage: many peers' lab runs without transformers
peer_memory           what each peer of a running swarm holds in memory (RSS, PSS, private), its p2pd apart
gloo/                 the torch.distributed baseline (`--codecs torch:gloo`): the same stages over gloo
"""
