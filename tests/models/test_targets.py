"""What a model's loss takes as targets (swarm.models.base.Targets): every built-in model says it,
and anything else is named in a few words (a stage peer refuses it as its sender's fault)."""

from __future__ import annotations

import torch

from swarm.models import build_model
from swarm.models.base import Targets


def test_built_in_models_say_what_their_loss_takes():
    digits = build_model("digits_mlp", 2, num_classes=7)
    assert digits.targets == Targets(7, probabilities=True)
    gpt2 = build_model("gpt2", 2, config={"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 50})
    assert gpt2.targets == Targets(50, dims=1, ignore=-100, samples=True)
    for staged, good in ((digits, torch.tensor([0, 6])), (gpt2, torch.tensor([[0, 49, -100]]))):
        assert staged.targets.problem(good) is None
        staged.loss(staged(torch.randn(2, 64) if staged is digits else good.clamp(min=0)), good)  # the loss takes them


def test_anything_else_is_named():
    classes = Targets(10, probabilities=True)
    assert classes.problem(torch.tensor([1.0, 2.0])) == (
        "float32 values of shape (2,): the loss takes class indices (int64) or probabilities of shape (N, 10)"
    )
    assert classes.problem(torch.rand(2, 10)) is None  # soft labels
    assert classes.problem(torch.tensor([3, 10])) == "class index 10 outside 0..9"
    assert classes.problem(torch.tensor([-1, 3])) == "class index -1 outside 0..9"
    assert classes.problem(torch.tensor([[1, 2]])).startswith(
        "shape (1, 2): the loss takes class indices, one per sample"
    )
    assert classes.problem(torch.tensor([1], dtype=torch.int32)).startswith("int32 values")
    tokens = Targets(50, dims=1, ignore=-100)
    assert tokens.problem(torch.tensor([[1, -101]])) == "class index -101 outside 0..49"
    assert tokens.problem(torch.tensor([1, 2])).startswith("shape (2,): the loss takes class indices, 2-D")
    assert tokens.problem(torch.rand(2, 50)).startswith(
        "float32 values of shape (2, 50): the loss takes class indices (int64)"
    )
