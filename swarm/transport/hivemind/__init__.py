"""The hivemind transport: stage peers on hivemind's P2P serving the same `StageRuntime` and step
that the in-process transport drives, found through the DHT. Its subpackages, lowest first (each
imports only those before it):

- `flow/`: one link's flow: pacing what is sent, metering what arrives, busy time, link order.
- `trust/`: the run's owner: keys, signed calls, admissions, tokens, the gate every call passes.
- `net/`: a peer on hivemind: settings, node and event loops, framed calls on pooled streams, bans,
  retries, what travels with a request, its event log.
- `dht/`: the swarm on the DHT: stage records, the run's published config and status, surveys.
- `routing/`: choosing the next stage's peer (one policy) and handing a micro-batch to it.
- `stage/`: the stage peer (its server, the hosted stage and the collaborators serving its calls).
- `trainer/`: the trainer's `SwarmPipeline` and its step rounds, setups, recovery and accounts.
- `monitor/`: Prometheus metrics and the health page.
"""

from swarm.transport.hivemind.lean import defer

defer()  # before any hivemind import of ours: a peer skips the parts of hivemind it never uses (lean.py)
