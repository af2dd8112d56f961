"""`train.schedule: async` in a swarm (swarm.engine.delay): each step's update applies the gradients
of the step before it, so the next step's micro-batches enter while a step's are in flight
(trainer.dispatch), every stage applies step t's gradients when step t + 2's first micro-batch
arrives (trainer.closing, stage.closing) and keeps the version step t + 1's pending backward needs
(swarm.engine.stage: weight stashing).

What it does not run with yet is refused when the trainer starts, in one line: codecs that change
(compression.adaptive), verification, recomputed activations (a backward would recompute at the
newer weights), the swarm's copies and checkpoints (a drained stage would have to write its kept
gradients). A stage with two peers, a joiner or tied parameters are refused at the first step they
meet (trainer.closing). Every delay correction runs (swarm.engine.versions; dc's norms come a step
late: trainer.late_norms).
"""

from __future__ import annotations

from swarm.config import ExperimentConfig

DEPTH = {"sync": 1, "async": 2}  # steps a stage has open at once (trainer.closing's depth)


def refuse_unsupported(cfg: ExperimentConfig, snapshot_every: int, checkpoints: bool = False) -> None:
    """Raises ValueError, in one line, for what a swarm cannot run with an asynchronous schedule yet."""
    if cfg.train.schedule == "sync":
        return
    missing = []
    if cfg.compression.adaptive is not None:
        missing.append("compression.adaptive")
    if cfg.train.verify:
        missing.append("train.verify")
    if cfg.train.checkpoint_activations:
        missing.append("train.checkpoint_activations")
    if snapshot_every:
        missing.append("the swarm's copies (--snapshot_every 0)")
    if checkpoints:
        missing.append("checkpoints")
    if missing:
        raise ValueError(
            f"train.schedule: {cfg.train.schedule} in a swarm runs without {', '.join(missing)} so far (python -m swarm run has them)"
        )
