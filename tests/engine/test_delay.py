"""`train.schedule: async` in one process (swarm.engine.delay): every step applies the step before's
gradients, optionally delay-compensated; checkpoints carry what the next step applies."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _util import SMOKE

from swarm.config import ConfigError, load_config
from swarm.config.schedule import DelayCorrection
from swarm.data import collate
from swarm.engine.microbatch import Mode
from swarm.training.experiment import build_data
from swarm.training.loop import split_micro_batches
from swarm.transport.local import build_local_pipeline

BASE = ["model.num_stages=3", "compression.forward=quant:4", "compression.backward=quant:4", "optimizer.grad_clip=0.5"]


def _steps(cfg, count: int):
    train_set = build_data(cfg)[0]
    size = cfg.train.batch_size
    for step in range(count):
        ids, inputs, targets = collate([train_set[i] for i in range(step * size, (step + 1) * size)])
        yield split_micro_batches(step, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, False)


def _run(cfg, steps: int, pipeline=None, first: int = 0):
    """Losses of steps `first`..`steps - 1`, and the pipeline after them."""
    pipeline = pipeline or build_local_pipeline(cfg, 100)[0]
    losses = []
    for items in list(_steps(cfg, steps))[first:]:
        losses.append(sum(m["loss"] * b.weight for (b, _), m in zip(items, pipeline.run_many(items), strict=True)))
        pipeline.step()
    return losses, pipeline


def _weights(pipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for r in pipeline.runtimes for p in r.module.parameters()]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_each_step_applies_the_gradients_of_the_step_before():
    sync = load_config(SMOKE, BASE)
    delayed = load_config(SMOKE, [*BASE, "train.schedule=async"])
    start = _weights(build_local_pipeline(delayed, 100)[0])
    _, after_one = _run(delayed, 1)
    assert _equal(_weights(after_one), start)  # the first step applies nothing
    sync_losses, sync_one = _run(sync, 1)
    async_losses, after_two = _run(delayed, 2)
    # step 2 applied step 1's gradients, computed at the first weights: one synchronous step
    assert _equal(_weights(after_two), _weights(sync_one))
    assert async_losses[0] == sync_losses[0]
    sync_two, _ = _run(sync, 2)
    assert async_losses[1] != sync_two[1]  # its second step still ran at the first weights


def test_delay_compensation_changes_the_update_and_needs_a_strength():
    none_losses, none_run = _run(load_config(SMOKE, [*BASE, "train.schedule=async", "train.delay_correction=none"]), 4)
    dc_losses, dc_run = _run(load_config(SMOKE, [*BASE, "train.schedule=async", "train.delay_correction=dc:2.0"]), 4)
    assert none_losses[:3] == dc_losses[:3]  # steps 2 and 3 apply gradients of weights that had not moved yet
    assert not _equal(_weights(none_run), _weights(dc_run))
    assert DelayCorrection.parse("dc:0.1") == DelayCorrection("dc", 0.1)
    for spec in ("dc", "dc:0", "dc:-1", "dc:nan", "lookahead:2", "dc:x"):
        with pytest.raises(ValueError, match="expected none, lookahead or dc:LAMBDA"):
            DelayCorrection.parse(spec)
    with pytest.raises(ConfigError, match="expected none, lookahead or dc:LAMBDA"):
        load_config(SMOKE, ["train.delay_correction=dc"])
    with pytest.raises(ConfigError, match="schedule"):
        load_config(SMOKE, ["train.schedule=later"])


def test_look_ahead_trains_at_the_predicted_weights_and_evaluates_at_the_weights():
    cfg = load_config(SMOKE, [*BASE, "train.schedule=async", "train.delay_correction=lookahead"])
    plain_losses, plain = _run(load_config(SMOKE, [*BASE, "train.schedule=async", "train.delay_correction=none"]), 3)
    ahead_losses, ahead = _run(cfg, 3)
    # the first update is at step 2; step 3 runs at v_2 + (v_2 - v_1), the weights after it are v_3
    assert ahead_losses[:2] == plain_losses[:2] and ahead_losses[2] != plain_losses[2]
    delays = [r.delay for r in ahead.runtimes]
    assert all(d.moved is not None for d in delays)
    between = _weights(ahead)
    with contextlib.ExitStack() as stack:
        for r in ahead.runtimes:
            stack.enter_context(r.delay.ahead(r.module))
        predicted = _weights(ahead)
    assert _equal(_weights(ahead), between) and not _equal(predicted, between)  # restored exactly
    moved = [m for d in delays for m in d.moved.values()]
    assert all(torch.equal(p, b + m) for p, b, m in zip(predicted, between, moved, strict=True))
    assert _equal(_weights(plain), between)  # both applied step 2's gradients, computed before any look-ahead


def test_a_checkpoint_carries_the_gradients_the_next_step_applies(tmp_path):
    cfg = load_config(SMOKE, [*BASE, "train.schedule=async", "train.delay_correction=lookahead"])
    whole, uninterrupted = _run(cfg, 5)
    first, before = _run(cfg, 3)
    before.save_checkpoint(tmp_path, 3)
    resumed = build_local_pipeline(cfg, 100)[0]
    assert resumed.load_checkpoint(tmp_path) == 3
    rest, after = _run(cfg, 5, resumed, first=3)
    assert first + rest == whole and _equal(_weights(after), _weights(uninterrupted))
    synchronous = build_local_pipeline(load_config(SMOKE, BASE), 100)[0]
    with pytest.raises(ValueError, match="of an asynchronous schedule; this run has a synchronous one"):
        synchronous.load_checkpoint(tmp_path)
