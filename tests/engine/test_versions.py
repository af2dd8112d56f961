"""A swarm stage's delay corrections (swarm.engine.versions), in one process: stage runtimes driven
as a swarm's peers drive them (gradients held per micro-batch, step t applied when step t + 2's first
micro-batch comes, the last backward of step t - 1 still pending at stage 0 when that happens) give
one process's asynchronous run's floats bit for bit, for every delay correction."""

from __future__ import annotations

import pytest
import torch
from _util import SMOKE
from test_delay import _run, _steps, _weights

from swarm.config import load_config
from swarm.engine.microbatch import Kind, Mode
from swarm.engine.step import clip_scale
from swarm.engine.versions import StepVersions
from swarm.transport.local import build_local_pipeline

BASE = [
    "model.num_stages=3",
    "compression.forward=quant:4+ef",
    "compression.backward=quant:4",
    "optimizer.grad_clip=0.05",
    "train.schedule=async",
]
STEPS = 6


def _into_stage0(message) -> bool:
    return message.kind is Kind.BACKWARD and message.to_stage == 0


def _as_a_swarm(cfg, steps: int):
    """Losses of `steps` steps run as a swarm's stages run them, and the pipeline after them."""
    pipeline = build_local_pipeline(cfg, 100)[0]
    runtimes = pipeline.runtimes
    for runtime in runtimes:
        runtime.hold_grads = True
        runtime.versions = StepVersions(runtime.delay)

    def apply(step: int) -> None:  # the owner's decision (the stages' norms, in stage order) and its apply
        keys = [(Mode.TRAIN.value, step, i) for i in range(cfg.train.micro_batches)]
        squares = 0.0
        for runtime in runtimes:
            squares += runtime.held_sq_norm(keys)
        scale = clip_scale(squares, [], cfg.optimizer.grad_clip)
        for runtime in runtimes:
            runtime.accumulate(keys)
            if scale:
                runtime.scale_grads(scale)
            runtime.apply_step(keys)

    losses, pending = [], None
    for step, items in enumerate(_steps(cfg, steps)):
        loss = 0.0
        for i, (batch, inputs) in enumerate(items):
            if i == 0 and step >= 2:
                apply(step - 2)
            message = runtimes[0].forward(batch, inputs, pipeline.ends[0])
            if i == 0 and pending is not None:  # the step before's last backward, after the update
                pipeline.carry(*pending)
            last = i == len(items) - 1
            message = pipeline.carry(batch, message, _into_stage0 if last else None)
            loss += batch.weight * message.metrics["loss"]  # the loss rides to stage 0 with the gradient
            if last:
                pending = (batch, message)
        losses.append(loss)
    pipeline.carry(*pending)
    apply(steps - 2)  # what one process's last step applies
    return losses, pipeline


@pytest.mark.parametrize("correction", ["none", "lookahead", "dc:100000"])  # dc: a strength that shows
def test_a_swarms_stages_give_one_process_floats_for_every_correction(correction):
    cfg = load_config(SMOKE, [*BASE, f"train.delay_correction={correction}"])
    ours, swarm_like = _as_a_swarm(cfg, STEPS)
    theirs, one_process = _run(cfg, STEPS)
    assert ours == theirs
    assert all(torch.equal(a, b) for a, b in zip(_weights(swarm_like), _weights(one_process), strict=True))
    last = {(Mode.TRAIN.value, STEPS - 1, i) for i in range(cfg.train.micro_batches)}  # applied by none yet
    assert all(set(r.held) == last and not r.pending for r in swarm_like.runtimes)
    if correction != "none":  # the correction ran: not the uncorrected run's floats
        plain, _ = _run(load_config(SMOKE, [*BASE, "train.delay_correction=none"]), STEPS)
        assert ours[:2] == plain[:2] and ours[3:] != plain[3:]


def test_look_ahead_runs_a_step_with_parameter_objects_of_its_own_and_gives_the_module_back():
    cfg = load_config(SMOKE, [*BASE, "train.delay_correction=lookahead"])
    runtime = _as_a_swarm(cfg, 3)[1].runtimes[1]  # two updates applied: `moved` is the second's
    own = dict(runtime.module.named_parameters())
    with runtime.versions.running(3, runtime.module):
        inside = dict(runtime.module.named_parameters())
    moved = runtime.delay.moved
    assert moved.keys() == own.keys()
    assert all(inside[n] is not p and torch.equal(inside[n], p + moved[n]) for n, p in own.items())
    assert all(a is b for a, b in zip(own.values(), runtime.module.parameters(), strict=True))
    runtime.versions.applied(3, runtime.module)  # the step's version goes with its apply
    assert runtime.versions.ahead == {}
