"""The hivemind transport: stage peers on hivemind's P2P serving the same `StageRuntime` and step
that the in-process transport drives, found through the DHT.

Shared plumbing, used by both sides:
- `settings`: every timeout and limit; `node`: one peer's P2P daemon and DHT node; `loop`: event loops
- `streams`, `calls`: the one client stack (framed exchanges on pooled streams), `errors`
- `retry`: the one retry policy; `handoff`: handing a micro-batch to the next stage, failing over
- `ordering`: link order (epochs, sequence numbers); `pacing`: per-flow pacing; `meter`: link rates
- `meta`: what travels with a request; `announce`, `routing`: DHT records and choosing peers
- `survey`: the swarm as a table (peers.status); `trust`: the run's owner, signatures, admissions
The stage peer's side is `stage/` (host, links, chain, rounds, server), the trainer's `trainer/`
(pipeline, rounds, adaptive).
"""
