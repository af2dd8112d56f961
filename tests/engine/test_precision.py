"""A stage's forward under `train.precision` (autocast) and `train.checkpoint_activations`."""

from __future__ import annotations

import pytest
import torch
from _swarm_env import smoke

from swarm.engine.precision import Forward, check_precision
from swarm.training.experiment import run_experiment


def _run(tmp_path, *overrides: str) -> list[float]:
    from swarm.training.results import read_results

    path = tmp_path / f"run-{len(list(tmp_path.iterdir()))}.jsonl"
    cfg = smoke("model.num_stages=3", "train.eval_every=100", *overrides)
    run_experiment(cfg, path, max_steps=3, progress=False)
    return [r["loss"] for r in read_results(path) if r["type"] == "step"]


def test_checkpointed_activations_compute_the_same_losses(tmp_path):
    plain = _run(tmp_path)
    assert len(plain) == 3
    assert _run(tmp_path, "train.checkpoint_activations=true") == plain


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lower_precision_runs_and_codecs_see_its_dtype(tmp_path, precision):
    plain = _run(tmp_path)
    lower = _run(
        tmp_path, f"train.precision={precision}", "compression.forward=quant:4", "compression.backward=quant:8"
    )
    assert all(torch.isfinite(torch.tensor(lower))) and lower != plain
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    linear = torch.nn.Sequential(torch.nn.Linear(8, 4))
    out = Forward(precision)(linear, torch.randn(2, 8), training=True)
    assert out.dtype == dtype  # what a link's codec gets from a stage ending in a matrix product
    assert linear[0].weight.dtype == torch.float32  # weights stay fp32


def test_devices_that_cannot_autocast_say_so_in_one_line():
    check_precision("fp32", "meta")
    with pytest.raises(ValueError, match="meta has no autocast; use fp32"):
        check_precision("bf16", "meta")
    with pytest.raises(ValueError, match="must be one of fp32, bf16, fp16"):
        check_precision("fp8", "cpu")


def test_checkpointing_repeats_dropout_masks():
    from swarm.models import build_model

    config = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.3, attn_pdrop=0.3)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        stage = build_model("gpt2", 1, config=config).stages[0].train()
        ids = torch.randint(0, 50, (2, 12))
        torch.manual_seed(5)
        Forward(checkpointing=checkpointing)(stage, ids, training=True).square().mean().backward()
        grads.append([p.grad.clone() for p in stage.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_micro_batch_draws_the_same_dropout_masks_wherever_and_whenever_it_runs():
    layer = torch.nn.Dropout(0.5)
    x = torch.ones(4, 64)
    forward = Forward(seed=7)
    first = forward(layer, x, training=True, stream=(1, 3, 0))
    torch.rand(100)  # other work in between moves the global generator
    again = Forward(seed=7)(layer, x, training=True, stream=(1, 3, 0))
    assert torch.equal(first, again)
    assert not torch.equal(first, forward(layer, x, training=True, stream=(1, 3, 1)))  # another micro-batch
    assert not torch.equal(first, Forward(seed=8)(layer, x, training=True, stream=(1, 3, 0)))  # another run
    state = torch.get_rng_state()
    forward(layer, x, training=True, stream=(0, 0, 0))
    assert torch.equal(state, torch.get_rng_state())  # the global generator is left as it was
