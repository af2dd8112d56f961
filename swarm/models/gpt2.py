"""GPT-2 (Hugging Face transformers classes) cut into pipeline stages.

Stage 0: token + position embeddings and the first blocks; middle stages: blocks; last stage:
its blocks, ln_f and the LM head. Stage boundaries carry plain hidden states [B, T, d]; each
stage builds the same causal mask the unsplit GPT2Model builds, so a block runs standalone and
the composed stages compute what GPT2LMHeadModel computes.

The LM head is tied to the token embedding. Split over several stages, the last stage holds its
own copy (an exact clone at build time), listed in `StagedModel.tied`; the synchronous step
(`swarm.engine.step.tie`) gives both copies the sum of their gradients (what the unsplit model's
shared weight receives), so the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask

from swarm.models.base import StagedModel, TiedPair, causal_lm_loss, causal_lm_metrics, plan_cuts, stage_block_ranges


class GPT2Stage(nn.Module):
    """A contiguous piece of GPT2LMHeadModel; parameter names follow HF (`h.<global index>...`)."""

    def __init__(
        self,
        config: GPT2Config,
        blocks: dict[int, nn.Module],
        embeddings: tuple[nn.Embedding, nn.Embedding, nn.Dropout] | None = None,
        head: tuple[nn.LayerNorm, nn.Linear] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.first = embeddings is not None
        self.last = head is not None
        if embeddings is not None:
            self.wte, self.wpe, self.drop = embeddings
        self.h = nn.ModuleDict({str(i): block for i, block in blocks.items()})
        if head is not None:
            self.ln_f, self.lm_head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length > self.config.n_positions:
            raise ValueError(f"gpt2: sequence length {length} exceeds n_positions={self.config.n_positions}")
        position_ids = torch.arange(length, device=x.device).unsqueeze(0)
        if self.first:
            if x.is_floating_point():
                raise ValueError(f"gpt2: stage 0 takes token ids (an integer tensor [B, T]), got {x.dtype}")
            hidden = self.wte(x) + self.wpe(position_ids)
            hidden = self.drop(hidden)
        else:
            hidden = x
        if len(self.h):
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                past_key_values=None,
                position_ids=position_ids,
            )
            for block in self.h.values():
                hidden = block(
                    hidden, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=position_ids
                )
        if self.last:
            hidden = self.lm_head(self.ln_f(hidden))
        return hidden


def make_config(config: dict[str, Any] | str | GPT2Config | None) -> GPT2Config:
    """A GPT2Config from kwargs, a directory / hub name holding config.json, or a config."""
    if isinstance(config, GPT2Config):
        return config
    if isinstance(config, str):
        try:
            return GPT2Config.from_pretrained(config)
        except (OSError, ValueError) as e:
            raise ValueError(f"gpt2: cannot load config {config!r}: {str(e).splitlines()[0]}") from None
    kwargs = dict(config or {})
    known = set(GPT2Config().to_dict()) | {"attn_implementation", "n_ctx"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"gpt2: unknown config key(s) {', '.join(unknown)}")
    vocab = kwargs.get("vocab_size", 50257)
    for token in ("bos_token_id", "eos_token_id"):  # the defaults (50256) fall outside a tiny vocabulary
        if token not in kwargs and vocab <= 50256:
            kwargs[token] = vocab - 1
    return GPT2Config(**kwargs)


def load_full(config=None, pretrained: str | None = None) -> GPT2LMHeadModel:
    """The unsplit model: from `pretrained` (hub name or directory) or freshly initialised."""
    if pretrained is not None:
        overrides = dict(config or {}) if not isinstance(config, (str, GPT2Config)) else {}
        if isinstance(config, (str, GPT2Config)):
            overrides["config"] = make_config(config)
        try:
            return GPT2LMHeadModel.from_pretrained(pretrained, **overrides)
        except (OSError, ValueError) as e:
            raise ValueError(f"gpt2: cannot load pretrained weights {pretrained!r}: {str(e).splitlines()[0]}") from None
    return GPT2LMHeadModel(make_config(config))


def cut(
    model: GPT2LMHeadModel, num_stages: int, split_after: Sequence[int] | None = None
) -> tuple[list[nn.Module], list[TiedPair]]:
    """Stages sharing `model`'s modules; the last stage gets its own copy of a tied LM head."""
    transformer = model.transformer
    n = len(transformer.h)
    cuts = plan_cuts("gpt2", n, num_stages, split_after=split_after)
    tied_head = model.lm_head.weight is transformer.wte.weight
    lm_head = model.lm_head
    tied: list[TiedPair] = []
    if num_stages > 1 and tied_head:
        lm_head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)
        lm_head.weight = nn.Parameter(transformer.wte.weight.detach().clone())
        tied.append(TiedPair((0, "wte.weight"), (num_stages - 1, "lm_head.weight")))
    stages: list[nn.Module] = []
    for index, blocks in enumerate(stage_block_ranges(n, cuts)):
        stages.append(
            GPT2Stage(
                model.config,
                {i: transformer.h[i] for i in blocks},
                (transformer.wte, transformer.wpe, transformer.drop) if index == 0 else None,
                (transformer.ln_f, lm_head) if index == num_stages - 1 else None,
            )
        )
    return stages, tied


def build_gpt2(
    num_stages: int,
    config: dict[str, Any] | str | None = None,
    pretrained: str | None = None,
    split_after: Sequence[int] | None = None,
) -> StagedModel:
    """GPT-2 with a causal-LM loss; `config` = GPT2Config kwargs (default: gpt2-small) or a config path.

    Default cuts share the blocks out evenly: 12 layers in 4 stages -> after blocks 2, 5 and 8.
    """
    if pretrained is None:
        n_layer = make_config(config).n_layer
        plan_cuts("gpt2", n_layer, num_stages, split_after=split_after)  # fail before building anything
    model = load_full(config, pretrained)
    stages, tied = cut(model, num_stages, split_after)
    return StagedModel(stages, causal_lm_loss, causal_lm_metrics, tied)
