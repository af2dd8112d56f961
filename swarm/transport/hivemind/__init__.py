"""The hivemind transport: stage peers on hivemind's P2P serving the same `StageRuntime` that the
in-process transport drives, found through the DHT, and a trainer-side pipeline for `swarm.training.loop`.

- `chunks`, `meta`: payloads cut into checked chunks; micro-batch metadata and small raw tensors
- `node`: one peer's P2P daemon and DHT node; `loop`: a background event loop for sync callers
- `announce`: DHT records (one key per run and stage, one subkey per peer); `routing`: choosing peers
- `calls`: the client side of every RPC, with deadlines; `hosted`, `servicer`: the stage peer
- `pipeline`: `SwarmPipeline`, what `swarm.training.loop.train` drives; `status`: the swarm as a table
"""

PROTOCOL_VERSION = 1
