"""`train.schedule: async` in a swarm (swarm.engine.delay): each step's update applies the gradients
of the step before it, so the next step's micro-batches enter while a step's are in flight
(trainer.dispatch), every stage applies step t's gradients when step t + 2's first micro-batch
arrives (trainer.closing, stage.closing) and keeps the version step t + 1's pending backward needs
(swarm.engine.stash: weight stashing). Every delay correction runs (swarm.engine.versions; dc's
norms come a step late: trainer.late_norms).

A drained stage holds its last step's gradients unapplied: its checkpoints and the swarm's copies
write them as one process's kept gradients (StageState.saved), a restore holds them again and the
trainer makes that step's decision anew (trainer.closing `reopen`); a step that cannot close on the
way closes by a round of the held gradients' norms (trainer.closing `late_round`).

Everything a synchronous swarm runs, an asynchronous one runs. Verification: a step with a check
holds the next step's micro-batches back until it is done (trainer.dispatch). Adaptive codecs: the
pipeline drains after a step whose decision is due, and the changes go with the apply round of
the step before (trainer.closing `switch`). Recomputed activations (train.checkpoint_activations)
run: the recomputation uses the parameter objects its forward ran with (swarm.engine.precision).
A delay correction's per-step weights (swarm.engine.versions: dc's weights of the held step,
lookahead's last move) are in checkpoints and the swarm's copies as one process's. Replicas sum
each step by one round overlapped with the next step's micro-batches (trainer.replicas) and
joiners are admitted where the pipeline drained (trainer.setups), with any delay correction; so
are tied parameters, summed across their two stages by the same round after each stage's
correction (stage.combine). A micro-batch of step t that comes to a stage after step t + 1's first
(retried, or overtaken through another replica) runs at the version step t ran at, which the
stage keeps until its next update (swarm.engine.stash); an older one is refused, and the run goes
back to the swarm's copies (trainer.recovery, once a step), or ends without copies; so does a
replica lost in its step's round.
"""

from __future__ import annotations

DEPTH = {"sync": 1, "async": 2}  # steps a stage has open at once (trainer.closing's depth)
