"""Hugging Face causal-LM decoders (Llama, Mistral, Qwen2, GPT-NeoX, GPT-2, Falcon, Bloom, ...) cut into stages.

A decoder is [token embedding (+ absolute positions, dropout, a norm), layers, final norm, LM head]. The
first stage holds the embedding, the last the final norm and the head; stage boundaries carry
plain hidden states [B, T, d]. Each stage rebuilds what the unsplit model builds once for all its
layers (position ids, rotary cos/sin, the causal or sliding-window mask of each layer's type), so
a stage's layers run standalone and the composed stages compute what the unsplit model computes.

Stage attributes keep the family's own names (`embed_tokens`, `layers.<global index>`, `norm`,
`lm_head`; GPT-2: `wte`, `wpe`, `drop`, `h.<i>`, `ln_f`), and `DecoderStage.source_names` maps
them to the unsplit model's names (for adapters saved in the model's own layout).

A tied LM head (`tie_word_embeddings`) split over several stages gets its own copy in the last
stage, listed in `StagedModel.tied`; the step sums both copies' gradients, as the unsplit model's
shared weight receives them.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swarm.models.base import TiedPair, stage_block_ranges

# Families whose staged model is checked against the unsplit one by the tests (tests/models).
# Others with the same shape are checked once at build time on a probe input (`check_split`).
CHECKED_FAMILIES = ("llama", "mistral", "qwen2", "gpt_neox", "gpt2", "falcon", "bloom")

_ROLES = {  # role -> attribute names a family may use for it, in the base model
    "layers": ("layers", "h", "blocks"),
    "norm": ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f"),
    "positions": ("wpe",),
    "dropout": ("drop", "emb_dropout", "embed_dropout"),
    "rotary": ("rotary_emb",),
    "embed_norm": ("word_embeddings_layernorm",),
}
STEM_ROLES = ("embed", "positions", "dropout", "embed_norm")  # what stage 0 holds before the layers


@dataclass
class DecoderParts:
    """Where a causal LM keeps each piece: attribute names (in the base model, the head in the
    wrapper) and the modules."""

    names: dict[str, str]
    modules: dict[str, nn.Module]
    base_prefix: str

    @property
    def layers(self) -> nn.ModuleList:
        return self.modules["layers"]


def find_parts(model: nn.Module, where: str = "transformers") -> DecoderParts:
    """The pieces of a `...ForCausalLM`; one line naming what is missing or unplaced."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        raise ValueError(f"{where}: {model_type}: no base model under {prefix!r}; is it a causal LM?")
    names: dict[str, str] = {}
    modules: dict[str, nn.Module] = {}
    embed = base.get_input_embeddings()
    names["embed"] = next((n for n, m in base.named_children() if m is embed), "")
    for role, candidates in _ROLES.items():
        for name in candidates:
            module = getattr(base, name, None)
            if isinstance(module, nn.Module):
                names[role] = name
                break
    missing = [role for role in ("embed", "layers", "norm") if not names.get(role)]
    if missing or not isinstance(getattr(base, names.get("layers", ""), None), nn.ModuleList):
        raise ValueError(f"{where}: {model_type}: cannot find the decoder's {', '.join(missing) or 'layer list'}")
    modules = {role: getattr(base, name) for role, name in names.items()}
    placed = set(names.values())
    unplaced = [n for n, child in base.named_children() if n not in placed and any(True for _ in child.parameters())]
    if unplaced:
        raise ValueError(f"{where}: {model_type}: has parts a split cannot place ({', '.join(unplaced)})")
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_children() if m is head), "")
    if not head_name:
        raise ValueError(f"{where}: {model_type}: no LM head next to the base model")
    names["head"], modules["head"] = head_name, head
    return DecoderParts(names, modules, prefix)


def _mask_kind(config, index: int) -> str:
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


def _masks(config, kinds: set[str], hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
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


def _alibi_of(config, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
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


def _arguments_of(layer: nn.Module) -> frozenset[str] | None:
    """The keyword arguments a layer's forward takes (None: any). Bloom's layers in transformers
    5.0 take no position_ids; their positions are the ALiBi bias."""
    parameters = inspect.signature(layer.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


class DecoderStage(nn.Module):
    """A contiguous piece of a causal LM: optionally the embedding, some layers, optionally the head."""

    def __init__(self, config, parts: DecoderParts, layers: range, first: bool, last: bool, head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.first, self.last = first, last
        self.roles = {role: name for role, name in parts.names.items() if role != "layers"}
        if first:
            for role in STEM_ROLES:
                if role in parts.modules:
                    self.add_module(parts.names[role], parts.modules[role])
        self.layers_name = parts.names["layers"]
        self.add_module(self.layers_name, nn.ModuleDict({str(i): parts.layers[i] for i in layers}))
        self.kinds = {i: _mask_kind(config, i) for i in layers}
        self.rotary = parts.modules.get("rotary") if len(layers) else None
        # per layer: a family may mix layer classes
        self.alibi = {i: _alibi_of(config, parts.layers[i]) for i in layers}
        self.layer_takes = {i: _arguments_of(parts.layers[i]) for i in layers}
        if last:
            self.add_module(parts.names["norm"], parts.modules["norm"])
            self.add_module(parts.names["head"], head)
        self.source_names: dict[str, str] = {}

    def _part(self, role: str) -> nn.Module | None:
        name = self.roles.get(role)
        return self._modules.get(name) if name else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        position_ids = torch.arange(length, device=x.device).unsqueeze(0)
        if self.first:
            if x.is_floating_point():
                raise ValueError(
                    f"{self.config.model_type}: stage 0 takes token ids (an integer tensor [B, T]), got {x.dtype}"
                )
            hidden = self._part("embed")(x)
            positions = self._part("positions")
            if positions is not None:
                if length > positions.num_embeddings:
                    raise ValueError(
                        f"{self.config.model_type}: sequence length {length} exceeds the {positions.num_embeddings} positions"
                    )
                hidden = hidden + positions(position_ids)
            dropout = self._part("dropout")
            if dropout is not None:
                hidden = dropout(hidden)
            embed_norm = self._part("embed_norm")  # Bloom's, right after the embedding
            if embed_norm is not None:
                hidden = embed_norm(hidden)
        else:
            hidden = x
        layers = self._modules[self.layers_name]
        if len(layers):
            masks = _masks(self.config, set(self.kinds.values()), hidden, position_ids)
            extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids)}
            entering = hidden  # the unsplit model builds ALiBi from the hidden states its layers start with
            for index, layer in layers.items():
                i = int(index)
                arguments = {"attention_mask": masks[self.kinds[i]], "position_ids": position_ids, "use_cache": False}
                if (alibi := self.alibi[i]) is not None:
                    arguments["alibi"] = alibi(entering)  # [B * heads, 1, T]: cheap next to the layer
                arguments.update(extra)
                if (takes := self.layer_takes[i]) is not None:
                    arguments = {k: v for k, v in arguments.items() if k in takes}
                out = layer(hidden, **arguments)
                hidden = out[0] if isinstance(out, tuple) else out
        if self.last:
            hidden = self._part("head")(self._part("norm")(hidden))
        return hidden


# ---- where to cut ---------------------------------------------------------------------------------


def _size(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def balanced_starts(stem: int, layers: list[int], head: int, num_stages: int, first_layers: int = 0) -> list[int]:
    """The layer where each stage after the first starts, making the largest stage (in parameters:
    the stem counts in stage 0, the head in the last) as small as possible. Middle stages hold at
    least one layer, the first at least `first_layers`; the last may hold only the head."""
    n = len(layers)
    most = n + 2 - min(first_layers, 1)
    if num_stages > most:
        raise ValueError(
            f"transformers: {n} layers + embedding + head can be split into 1..{most} stages, not {num_stages}"
        )
    prefix = [0]
    for size in layers:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (stem if stage == 0 else 0) + (head if stage == num_stages - 1 else 0)

    # largest[s]: the smallest possible largest stage of stages 0..k-1 when stage k starts at layer s
    largest = {s: (cost(0, 0, s), [s]) for s in range(min(first_layers, n), n + 1)}
    for k in range(1, num_stages - 1):
        largest = {
            s: min((max(largest[p][0], cost(k, p, s)), [*largest[p][1], s]) for p in largest if p < s)
            for s in range(n + 1)
            if any(p < s for p in largest)
        }
    if num_stages == 1:
        return []
    return min((max(v, cost(num_stages - 1, s, n)), starts) for s, (v, starts) in largest.items())[1]


def check_starts(starts: list[int], num_layers: int, num_stages: int) -> list[int]:
    """`options.split`: S-1 strictly increasing layer indices in 0..num_layers."""
    if not isinstance(starts, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
        raise ValueError(f"transformers: split must be a list of layer indices, got {starts!r}")
    if len(starts) != num_stages - 1:
        raise ValueError(
            f"transformers: split needs {num_stages - 1} layer index(es) for {num_stages} stages, got {len(starts)}"
        )
    if any(s < 0 or s > num_layers for s in starts) or any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise ValueError(f"transformers: split must be increasing layer indices in 0..{num_layers}, got {list(starts)}")
    return list(starts)


def cut_decoder(
    model: nn.Module,
    num_stages: int,
    starts: list[int] | None = None,
    where: str = "transformers",
    first_layers: int = 0,
) -> tuple[list[DecoderStage], list[TiedPair]]:
    """Stages sharing `model`'s modules. `starts`: the layer where each later stage starts (default:
    balanced by parameters, with at least `first_layers` layers in stage 0). The last stage gets its
    own copy of a tied LM head."""
    parts = find_parts(model, where)
    n = len(parts.layers)
    if starts is None:
        stem = sum(_size(parts.modules.get(role)) for role in STEM_ROLES)
        head = _size(parts.modules["norm"]) + _size(parts.modules["head"])
        starts = balanced_starts(stem, [_size(layer) for layer in parts.layers], head, num_stages, first_layers)
    starts = check_starts(starts, n, num_stages)
    head = parts.modules["head"]
    embed = parts.modules["embed"]
    tied: list[TiedPair] = []
    if num_stages > 1 and head.weight is embed.weight:
        copy = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
        copy.weight = nn.Parameter(embed.weight.detach().clone())
        if head.bias is not None:
            copy.bias = head.bias
        head = copy
        tied.append(TiedPair((0, f"{parts.names['embed']}.weight"), (num_stages - 1, f"{parts.names['head']}.weight")))
    ranges = stage_block_ranges(n, [s - 1 for s in starts])
    stages = [
        DecoderStage(model.config, parts, blocks, index == 0, index == num_stages - 1, head)
        for index, blocks in enumerate(ranges)
    ]
    name_sources(model, stages)
    return stages, tied


def name_sources(model: nn.Module, stages: list[DecoderStage]) -> None:
    """Each stage parameter's name in the unsplit model (a tied head's copy: the head's name)."""
    source = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    head = model.get_output_embeddings()
    head_name = next(name for name, m in model.named_modules() if m is head)
    for stage in stages:
        for name, p in stage.named_parameters():
            fallback = (
                f"{head_name}.{name.rsplit('.', 1)[-1]}"
                if stage.last and name.startswith(stage.roles["head"])
                else name
            )
            stage.source_names[name] = source.get(id(p), fallback)
