"""`model.name: swarm.bench.tiny_decoder:build`: a GPT-style causal decoder in plain torch, one
block per stage, for lab runs of many peers on one machine.

The built-in `gpt2` takes its blocks from transformers, whose imports cost a stage peer about
250 MiB of resident memory (157 MiB its own: docs/bench/scale-lab.md, "Memory per peer"); this
one imports nothing beyond torch, so dozens of its stage peers fit where a dozen GPT-2 ones do.
Stage 0 embeds tokens and positions, the last adds the final norm and the LM head (untied).
"""

from __future__ import annotations

import torch
from torch import nn

from swarm.models.base import StagedModel, language_model


class Block(nn.Module):
    """Pre-norm self-attention (causal) and MLP, each around a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        later = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)  # a token sees none after it
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=later, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab_size: int, width: int, positions: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, width), nn.Embedding(positions, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


def build(
    num_stages: int, vocab_size: int = 384, width: int = 128, heads: int = 4, positions: int = 128
) -> StagedModel:
    stages = []
    for i in range(num_stages):
        layers = [Embed(vocab_size, width, positions)] if i == 0 else []
        layers.append(Block(width, heads))
        if i == num_stages - 1:
            layers += [nn.LayerNorm(width), nn.Linear(width, vocab_size)]
        stages.append(nn.Sequential(*layers))
    return language_model(stages, vocab_size, [])
