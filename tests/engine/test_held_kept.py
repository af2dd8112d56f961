"""A swarm's stage holds an asynchronous step's gradients per micro-batch (StageRuntime.held); one
process keeps their sum (StageDelay.kept). Checkpoints and copies convert between the two
(`held_kept`, `hold_kept`) with the same floats, so either transport resumes the other's."""

from __future__ import annotations

import pytest
import torch
from _util import SMOKE

from swarm.config import load_config
from swarm.data import collate
from swarm.engine.microbatch import Mode
from swarm.engine.stage import step_keys
from swarm.training.experiment import build_data
from swarm.training.loop import split_micro_batches
from swarm.transport.local import build_local_pipeline

ASYNC = ["model.num_stages=3", "compression.forward=quant:4", "compression.backward=quant:4", "train.schedule=async"]


def _step_zero(cfg):
    size = cfg.train.batch_size
    ids, inputs, targets = collate([build_data(cfg)[0][i] for i in range(size)])
    return split_micro_batches(0, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, False)


def _ran(hold: bool):
    """A one-process pipeline after step 0's micro-batches (forward and backward, not applied);
    `hold`: its stages hold each micro-batch's gradients apart, as a swarm's do."""
    cfg = load_config(SMOKE, ASYNC)
    pipeline = build_local_pipeline(cfg, 100)[0]
    for runtime in pipeline.runtimes:
        runtime.hold_grads = hold
    pipeline.run_many(_step_zero(cfg))
    if not hold:  # one process's step sums them into p.grad
        for runtime in pipeline.runtimes:
            runtime.accumulate_held()
    return cfg, pipeline


def test_the_held_sum_is_what_one_process_keeps_the_same_floats():
    cfg, held = _ran(hold=True)
    _, direct = _ran(hold=False)
    count = cfg.train.micro_batches
    for swarm_stage, one_process in zip(held.runtimes, direct.runtimes, strict=True):
        assert all(p.grad is None for p in swarm_stage.module.parameters())  # held apart, not accumulated
        kept = swarm_stage.held_kept(0, count)
        grads = {name: p.grad for name, p in one_process.module.named_parameters() if p.grad is not None}
        assert list(kept) == list(grads)
        assert all(torch.equal(kept[name], grads[name]) for name in grads)
        assert swarm_stage.held_kept(1, count) is None  # nothing of step 1 is held yet


def test_kept_held_again_sums_norms_and_applies_as_the_micro_batches_did():
    cfg, held = _ran(hold=True)
    count = cfg.train.micro_batches
    fresh = build_local_pipeline(cfg, 100)[0]
    for ran, runtime in zip(held.runtimes, fresh.runtimes, strict=True):
        runtime.hold_grads = True
        kept = ran.held_kept(0, count)
        runtime.hold_kept(0, count, kept)
        keys = step_keys(0, count)
        assert set(runtime.held) == set(keys) and all(runtime.held[key] == [] for key in keys[1:])
        assert runtime.held_sq_norm(keys) == ran.held_sq_norm(keys)  # the same floats: the decision's scale
        runtime.accumulate(keys)
        ran.accumulate(keys)
        for (name, p), (_, q) in zip(runtime.module.named_parameters(), ran.module.named_parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
        runtime.hold_kept(1, count, None)  # nothing kept (a run's first step): nothing held
        assert not any(key in runtime.held for key in step_keys(1, count))


@pytest.mark.parametrize("count", [1, 3])
def test_step_keys_are_the_training_keys_in_index_order(count):
    assert step_keys(5, count) == [(Mode.TRAIN.value, 5, i) for i in range(count)]


def test_a_replicated_steps_combined_sum_replaces_what_a_replica_held_until_applied():
    """A replica held micro-batches 0 and 2 of step 0; the replicas' sum (here: one process's, every
    micro-batch) is the step's gradients there (`hold_combined`): a checkpoint writes it, the apply
    takes it, and the micro-batches' own gradients go with it."""
    cfg, held = _ran(hold=True)
    _, direct = _ran(hold=False)
    count = cfg.train.micro_batches
    runtime, one_process = held.runtimes[1], direct.runtimes[1]
    for key in step_keys(0, count)[1::2]:  # the other replica's micro-batches
        del runtime.held[key]
    with pytest.raises(KeyError):
        runtime.held_kept(0, count)  # a part of the step: no sum of its own
    total = {name: p.grad.double() for name, p in one_process.module.named_parameters() if p.grad is not None}
    runtime.hold_combined(0, total)
    kept = runtime.held_kept(0, count)
    assert all(kept[name].dtype == torch.float32 and torch.equal(kept[name], total[name].float()) for name in total)
    assert runtime.sums_sq_norm(runtime.combined[0]) == one_process.grad_sq_norm()
    runtime.accumulate_step(0, count)
    assert all(
        torch.equal(p.grad, one_process.module.get_parameter(n).grad) for n, p in runtime.module.named_parameters()
    )
    runtime.apply_step(step_keys(0, count))
    assert runtime.combined == {} and not any(key in runtime.held for key in step_keys(0, count))


def test_the_verification_digest_is_the_gradients_bits():
    """`train.verify` with no tolerance compares a hash of a micro-batch's gradient bits: two runs of
    the same micro-batch agree, one ulp anywhere does not; with a tolerance, squared norms."""
    cfg, first = _ran(hold=True)
    _, second = _ran(hold=True)
    key = step_keys(0, cfg.train.micro_batches)[1]
    a, b = first.runtimes[1], second.runtimes[1]
    assert a.held_digest(key) == b.held_digest(key) and a.held_digest(key) == int(a.held_digest(key)) < 2**52
    name, grad = b.held[key][-1]
    b.held[key][-1] = (
        name,
        grad.clone()
        .view(-1)
        .index_put_((torch.tensor(0),), grad.view(-1)[0].nextafter(torch.tensor(1.0)))
        .view_as(grad),
    )
    assert a.held_digest(key) != b.held_digest(key)
    norm = sum(float(g.double().pow(2).sum()) for _, g in a.held[key])
    assert a.held_digest(key, exact=False) == norm
