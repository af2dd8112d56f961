"""GPT-2 (Hugging Face transformers classes) cut into pipeline stages by `swarm.models.decoders`.

Stage 0: token + position embeddings and the first blocks; middle stages: blocks; last stage:
its blocks, ln_f and the LM head (tied to the token embedding: the last stage holds a copy whose
gradients the step sums with the embedding's). What this module adds to the generic decoder
split: gpt2-small defaults for a config given as keyword arguments, and blocks shared out evenly
(`split_after`), as the paper's runs split them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swarm.config.messages import library_message
from swarm.models.base import StagedModel, config_errors, language_model, plan_cuts
from swarm.models.decoders import cut_decoder

if TYPE_CHECKING:  # transformers loads when a GPT-2 is built: a CLI that fails on its config does not wait for it
    from transformers import GPT2Config, GPT2LMHeadModel


def make_config(config: dict[str, Any] | str | GPT2Config | None) -> GPT2Config:
    """A GPT2Config from kwargs, a directory / hub name holding config.json, or a config."""
    from transformers import GPT2Config

    if isinstance(config, GPT2Config):
        return config
    if isinstance(config, str):
        try:
            return GPT2Config.from_pretrained(config)
        except (OSError, *config_errors()) as e:
            raise ValueError(f"gpt2: cannot load config {config!r}: {library_message(e)}") from None
    kwargs = dict(config or {})
    known = set(GPT2Config().to_dict()) | {"attn_implementation", "n_ctx"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"gpt2: unknown config key(s) {', '.join(unknown)}")
    vocab = kwargs.get("vocab_size", 50257)
    for token in ("bos_token_id", "eos_token_id"):  # the defaults (50256) fall outside a tiny vocabulary
        if token not in kwargs and vocab <= 50256:
            kwargs[token] = vocab - 1
    try:
        return GPT2Config(**kwargs)
    except config_errors() as e:
        raise ValueError(f"gpt2: bad config ({library_message(e)})") from None


def load_full(config=None, pretrained: str | None = None) -> GPT2LMHeadModel:
    """The unsplit model: from `pretrained` (hub name or directory) or freshly initialised."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if pretrained is not None:
        overrides = dict(config or {}) if not isinstance(config, (str, GPT2Config)) else {}
        if isinstance(config, (str, GPT2Config)):
            overrides["config"] = make_config(config)
        try:
            return GPT2LMHeadModel.from_pretrained(pretrained, **overrides)
        except (OSError, *config_errors()) as e:
            raise ValueError(f"gpt2: cannot load pretrained weights {pretrained!r}: {library_message(e)}") from None
    built = make_config(config)
    try:
        return GPT2LMHeadModel(built)
    # a config it cannot be built from: heads that do not divide the width, a value of the wrong type
    except (RuntimeError, *config_errors()) as e:
        raise ValueError(f"gpt2: cannot build the model ({library_message(e)})") from None


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
    cuts = plan_cuts("gpt2", model.config.n_layer, num_stages, split_after=split_after)
    stages, tied = cut_decoder(model, num_stages, [c + 1 for c in cuts], where="gpt2")
    return language_model(stages, model.config.vocab_size, tied, model)
