"""swarm.bench.tiny_decoder: a causal decoder of one plain-torch block per stage, built as a user's
model (package.module:function) the way stage peers build it."""

from __future__ import annotations

import torch

from swarm.models.registry import build_model


def test_one_block_per_stage_and_a_token_sees_nothing_after_it():
    torch.manual_seed(0)
    model = build_model("swarm.bench.tiny_decoder:build", 3, vocab_size=20, width=16, heads=2, positions=8)
    assert len(model.stages) == 3
    ids = torch.randint(0, 20, (2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, 20)
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 20  # later tokens change: earlier positions' logits do not
    assert torch.equal(model(changed)[:, :5], logits[:, :5])
    assert not torch.equal(model(changed)[:, 5:], logits[:, 5:])
    loss = model.loss(logits, ids)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for s in model.stages for p in s.parameters())
