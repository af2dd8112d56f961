"""The torch.distributed baseline: the same stage modules pipelined over gloo, for the benchmarks.

`--codecs torch:gloo` in `bench throughput` and `bench time-to-target` runs it on the same shaped
links as hivepipe: one process per stage and one for the trainer (`python -m swarm.bench.gloo`),
a gloo process group over TCP, the boundary tensors sent uncompressed with send/recv, the same
micro-batch schedule (micro-batches per step, in flight at once) and the same synchronous step.

mailbox   pickled messages over gloo send/recv, one thread per neighbour and direction
stage     a stage's rank: the engine's stage runtime, driven by the messages it receives
trainer   the trainer's rank: a `Pipeline` for the training loop, the step's rounds as messages
launch    every rank as a process, in the lab's namespaces (swarm.lab.launch.Lab)
"""
