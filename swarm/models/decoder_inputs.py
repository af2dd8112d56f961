"""What each stage of a split decoder rebuilds for its layers, which the unsplit model builds once
in its base model's forward: the mask of each layer type, the embeddings' scale, absolute position
embeddings, Bloom's ALiBi bias, the arguments each layer takes; and the transform of the logits the
`...ForCausalLM` applies after its head (swarm.models.decoders places all of them)."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

# The logits' transform the ...ForCausalLM applies after its head (its config key -> the transform):
# Gemma 2 and 3 soft-cap them, Cohere scales them up, Granite down
LOGIT_TRANSFORMS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "final_logit_softcapping": lambda logits, cap: torch.tanh(logits / cap) * cap,
    "logit_scale": lambda logits, scale: logits * scale,
    "logits_scaling": lambda logits, scaling: logits / scaling,
}


def mask_kind(config, index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


@functools.cache
def _mask_makers() -> tuple[dict, frozenset]:
    """transformers' mask functions by layer type, and the names of their arguments, which moved
    within 5.x (`input_embeds` -> `inputs_embeds`, `past_key_values` -> `cache`, `cache_position`
    dropped): the old names still work in 5.24 with a FutureWarning on every call."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return makers, frozenset(inspect.signature(create_causal_mask).parameters)


def masks(config, kinds: set[str], hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
    makers, names = _mask_makers()
    unknown = sorted(kinds - set(makers))
    if unknown:
        raise ValueError(f"transformers: layer type(s) {', '.join(unknown)} are not supported")
    common = {
        "config": config,
        "inputs_embeds" if "inputs_embeds" in names else "input_embeds": hidden,
        "attention_mask": None,
        "cache" if "cache" in names else "past_key_values": None,
        "position_ids": position_ids,
    }
    if "cache_position" in names:
        common["cache_position"] = position_ids[0]
    return {kind: makers[kind](**common) for kind in kinds}


def embed_scale(config, base: nn.Module, embed: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a family's base model multiplies its embeddings by in its own forward (None: nothing).
    Granite's (and its kin's) `embedding_multiplier`, a Python float. Gemma and Gemma 2 in
    transformers 5.0: sqrt(hidden size), rounded to the embeddings' dtype first; later releases
    moved that into the embedding module (`embed_scale`), which stage 0 holds."""
    multiplier = getattr(base, "embedding_multiplier", None)
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool):
        return lambda hidden: hidden * multiplier
    if config.model_type in ("gemma", "gemma2", "vaultgemma") and not hasattr(embed, "embed_scale"):
        normalizer = config.hidden_size**0.5
        return lambda hidden: hidden * torch.tensor(normalizer, dtype=hidden.dtype)
    return None


def alibi_of(config, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """The `alibi` argument of a family's layers, from a stage's hidden states (None: they take
    none). Bloom's is each head's bias by key position, which the unsplit model builds once for all
    layers and a stage rebuilds, as it does rotary cos/sin; Falcon's is None unless its config
    uses ALiBi, whose bias Falcon folds into the attention mask (refused)."""
    if "alibi" not in inspect.signature(layer.forward).parameters:
        return None
    if not getattr(config, "alibi", True):
        return lambda hidden: None
    build = getattr(sys.modules[type(layer).__module__], "build_alibi_tensor", None)
    if config.model_type == "falcon" or build is None:
        raise ValueError(f"transformers: {config.model_type} with alibi positions is not supported")
    heads = config.num_attention_heads
    # an attention mask of ones as the unsplit model would take it: integers, whose running sum
    # (the key positions) stays exact past 256, where a bf16 one would not
    return lambda hidden: build(
        torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device), heads, hidden.dtype
    )


def arguments_of(layer: nn.Module) -> frozenset[str] | None:
    """The keyword arguments a layer's forward takes (None: any). Bloom's layers in transformers
    5.0 take no position_ids; their positions are the ALiBi bias."""
    parameters = inspect.signature(layer.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


def position_embeddings(config, positions: nn.Embedding, position_ids: torch.Tensor) -> torch.Tensor:
    """Absolute position embeddings. OPT's table starts `offset` (2) rows in, and its forward
    derives positions from an attention mask: the table is read directly."""
    offset = getattr(positions, "offset", 0)
    if position_ids.shape[-1] > positions.num_embeddings - offset:
        raise ValueError(
            f"{config.model_type}: sequence length {position_ids.shape[-1]} exceeds the"
            f" {positions.num_embeddings - offset} positions"
        )
    return nn.Embedding.forward(positions, position_ids + offset)
