"""Names both ends of a stage call read: the keys of a micro-batch reply's metrics a stage adds and
the trainer (or the stage before) reads, and the words of a refusal the trainer acts on. They live
here, below the stage peer and the trainer, so neither imports the other for them."""

from __future__ import annotations

# + the stage: a reply's metric of the squared norm of its gradients of the micro-batch (train.verify)
DIGEST = "grad_digest:"
SQUARE = "grad_sq:"  # + the stage: a reply's metric of that stage's squared gradient norm (stage.closing)
LATE = "grad_sq_before:"  # + the stage: dc's squared norm of the step before the reply's
RERUN = "step_rerun"  # a reply's metric: a micro-batch of the step finished twice somewhere
LR = "step_lr"  # a reply's metric: the learning rate the step will be applied with
# the refusal of an asynchronous step's micro-batch sent again once the next step's moved the
# weights on (stage.admission): the trainer goes back to the swarm's copies on it (trainer.recovery)
OUTRUN = "so a micro-batch of an earlier step cannot run again"
