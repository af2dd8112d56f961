"""`train.schedule: async` in a swarm (swarm.engine.delay): each step's update applies the gradients
of the step before it, so the next step's micro-batches enter while a step's are in flight
(trainer.dispatch), every stage applies step t's gradients when step t + 2's first micro-batch
arrives (trainer.closing, stage.closing) and keeps the version step t + 1's pending backward needs
(swarm.engine.stage: weight stashing). Every delay correction runs (swarm.engine.versions; dc's
norms come a step late: trainer.late_norms).

A drained stage holds its last step's gradients unapplied: its checkpoints and the swarm's copies
write them as one process's kept gradients (StageState.saved), a restore holds them again and the
trainer makes that step's decision anew (trainer.closing `reopen`); a step that cannot close on the
way closes by a round of the held gradients' norms (trainer.closing `late_round`).

What it does not run with yet is refused when the trainer starts, in one line: codecs that change
(compression.adaptive). Verification runs: a step with a check holds the next step's micro-batches
back until it is done (trainer.dispatch). Recomputed activations (train.checkpoint_activations)
run: the recomputation uses the parameter objects its forward ran with (swarm.engine.precision).
A delay correction's per-step weights (swarm.engine.versions: dc's weights of the held step,
lookahead's last move) are in checkpoints and the swarm's copies as one process's. Replicas sum
each step by one round overlapped with the next step's micro-batches (trainer.replicas) and
joiners are admitted where the pipeline drained (trainer.setups), with any delay correction; so
are tied parameters, summed across their two stages by the same round after each stage's
correction (stage.combine). A retried micro-batch of step t that comes after step t + 1's first
micro-batch reached its stages is refused there (their weights serve step t + 1 only): the run
goes back to the swarm's copies (trainer.recovery, once a step), or ends without copies; so does
a replica lost in its step's round.
"""

from __future__ import annotations

from swarm.config import ExperimentConfig

DEPTH = {"sync": 1, "async": 2}  # steps a stage has open at once (trainer.closing's depth)


def refuse_unsupported(cfg: ExperimentConfig) -> None:
    """Raises ValueError, in one line, for what a swarm cannot run with an asynchronous schedule yet."""
    if cfg.train.schedule != "sync" and cfg.compression.adaptive is not None:
        raise ValueError(
            f"train.schedule: {cfg.train.schedule} in a swarm runs without compression.adaptive so far (python -m swarm run runs it)"
        )
