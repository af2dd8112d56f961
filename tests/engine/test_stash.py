"""Weight stashing (swarm.engine.stage, PipeDream-2BW): with an asynchronous schedule a swarm's stage
applies an update while micro-batches of the step before still wait for their backward there; they
must get the gradients they would have got had nothing moved, and the update must step the same
weights. A synchronous stage never swaps its parameters."""

from __future__ import annotations

import pytest
import torch
from _util import SMOKE

from swarm.config import load_config
from swarm.data import collate
from swarm.engine.microbatch import Mode
from swarm.training.experiment import build_data
from swarm.training.loop import split_micro_batches
from swarm.transport.local import build_local_pipeline

OVERRIDES = ["model.num_stages=2", "compression.forward=none", "compression.backward=none", "optimizer.name=adamw"]


def _pipeline(schedule: str):
    cfg = load_config(SMOKE, [*OVERRIDES, f"train.schedule={schedule}"])
    pipeline = build_local_pipeline(cfg, 100)[0]
    for runtime in pipeline.runtimes:
        runtime.hold_grads = True  # as a swarm's stage peers hold them
    train_set = build_data(cfg)[0]
    size = cfg.train.batch_size
    steps = []
    for step in range(2):
        ids, inputs, targets = collate([train_set[i] for i in range(step * size, (step + 1) * size)])
        steps.append(split_micro_batches(step, ids, inputs, targets, 2, Mode.TRAIN, False))
    return pipeline, steps


def _on(pipeline, batch, message) -> None:
    """`message` through the rest of the pipeline, until the micro-batch is done."""
    pipeline.carry(batch, message)


def _update(runtime, keys) -> None:
    """An update of stage 0 with its gradients of `keys`, as a step's decision applies it."""
    runtime.accumulate(keys)
    runtime.apply_step(keys)


def _held(runtime) -> dict:
    return {key: {name: g.clone() for name, g in held} for key, held in runtime.held.items()}


def test_a_new_version_runs_while_the_old_ones_backward_is_pending():
    """Apart: step 0's micro-batches forward and backward, stage 0 applies them, then step 1's.
    Overlapped: step 1's forward at stage 0 runs at the new weights before step 0's second
    micro-batch's backward came back there. The same gradients, the same weights."""
    apart, steps = _pipeline("async")
    first, second = steps
    stage0 = apart.runtimes[0]
    _on(apart, first[0][0], stage0.forward(*first[0], apart.ends[0]))
    _on(apart, first[1][0], stage0.forward(*first[1], apart.ends[0]))
    _update(stage0, [first[0][0].key])
    _on(apart, second[0][0], stage0.forward(*second[0], apart.ends[0]))

    overlapped, _ = _pipeline("async")
    stage0 = overlapped.runtimes[0]
    _on(overlapped, first[0][0], stage0.forward(*first[0], overlapped.ends[0]))
    pending = stage0.forward(*first[1], overlapped.ends[0])  # its backward comes back later
    before = dict(stage0.module.named_parameters())
    _update(stage0, [first[0][0].key])
    after = dict(stage0.module.named_parameters())
    assert all(after[name] is not p for name, p in before.items())  # a new version; the old one stays
    assert len(stage0.optimizer.state) == len(after) and all(p in stage0.optimizer.state for p in after.values())
    _on(overlapped, second[0][0], stage0.forward(*second[0], overlapped.ends[0]))
    _on(overlapped, first[1][0], pending)

    ours, theirs = _held(stage0), _held(apart.runtimes[0])
    assert ours.keys() == theirs.keys() == {first[1][0].key, second[0][0].key}
    for key in ours:
        assert ours[key].keys() == theirs[key].keys()
        assert all(torch.equal(ours[key][name], theirs[key][name]) for name in ours[key])
    for a, b in zip(stage0.module.parameters(), apart.runtimes[0].module.parameters(), strict=True):
        assert torch.equal(a, b)
    keys = [first[1][0].key]  # summed as a step's closing sums them, and as accumulate does
    assert stage0.held_sq_norm(keys) == apart.runtimes[0].held_sq_norm(keys)
    stage0.accumulate(keys)
    assert stage0.grad_sq_norm() == stage0.held_sq_norm(keys)


def test_without_stashing_the_pending_backward_would_fail():
    """What the stash prevents: an in-place update under a pending graph breaks its backward."""
    pipeline, (first, _) = _pipeline("async")
    stage0 = pipeline.runtimes[0]
    _on(pipeline, first[0][0], stage0.forward(*first[0], pipeline.ends[0]))
    pending = stage0.forward(*first[1], pipeline.ends[0])
    delay, stage0.delay = stage0.delay, None  # as a synchronous stage: no stash
    _update(stage0, [first[0][0].key])
    stage0.delay = delay
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _on(pipeline, first[1][0], pending)


def test_a_synchronous_stage_keeps_its_parameter_objects():
    pipeline, (first, _) = _pipeline("sync")
    stage0 = pipeline.runtimes[0]
    for batch, inputs in first:
        _on(pipeline, batch, stage0.forward(batch, inputs, pipeline.ends[0]))
    before = list(stage0.module.parameters())
    stage0.accumulate([b.key for b, _ in first])
    stage0.apply_step()
    assert all(a is b for a, b in zip(before, stage0.module.parameters(), strict=True)) and not stage0.held
