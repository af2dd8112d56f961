"""The pipeline engine, transport-agnostic: what a stage computes and how a step ends.

- `microbatch`: a micro-batch and the messages between stages; `linkend`: one stage's half of a
  boundary (its codecs, error-feedback state and byte counts)
- `stage`: `StageRuntime`, one stage's module and optimizer driven by messages, with the link ends
  the transport picks per call
- `step`: the synchronous step's maths (gather, tie, set, clip, apply) over a transport's rounds
- `pipeline`: the `Pipeline` protocol the training loop drives (swarm.transport implements it)
- `build`: a config into runtimes and link ends; `optim`: optimizers and schedules;
  `checkpoint`: the stage checkpoint file format both transports read and write
"""
