"""Hugging Face causal-LM decoders (Llama, Mistral, Qwen2, GPT-NeoX, GPT-2, Falcon, Bloom, Gemma 2 and 3,
OPT, ...) cut into stages.

A decoder is [token embedding (+ a projection in, absolute positions, dropout, a norm), layers,
final norm, a projection out, LM head, a transform of the logits]. The first stage holds the
embedding, the last the final norm and the head; stage boundaries carry plain hidden states
[B, T, d]. Each stage rebuilds what the unsplit model builds once for all its layers (position
ids, rotary cos/sin of each layer's type, the causal or sliding-window mask of each layer's type),
so a stage's layers run standalone and the composed stages compute what the unsplit model computes.

Stage attributes keep the family's own names (`embed_tokens`, `layers.<global index>`, `norm`,
`lm_head`; GPT-2: `wte`, `wpe`, `drop`, `h.<i>`, `ln_f`), and `DecoderStage.source_names` maps
them to the unsplit model's names (for adapters saved in the model's own layout).

A tied LM head (`tie_word_embeddings`) split over several stages gets its own copy in the last
stage, listed in `StagedModel.tied`; the step sums both copies' gradients, as the unsplit model's
shared weight receives them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from swarm.models import decoder_inputs as stage_inputs
from swarm.models.base import StageCountError, TiedPair, stage_block_ranges

# Families whose staged model is checked against the unsplit one by the tests (tests/models).
# Others with the same shape are checked once at build time on a probe input (`check_split`).
CHECKED_FAMILIES = (
    *("llama", "mistral", "qwen2", "gpt_neox", "gpt2", "falcon", "bloom"),
    *("gemma2", "gemma3_text", "opt", "cohere", "granite"),
)

_ROLES = {  # role -> attribute names a family may use for it, in the base model
    "layers": ("layers", "h", "blocks"),
    "norm": ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f"),
    "positions": ("wpe", "embed_positions"),
    "dropout": ("drop", "emb_dropout", "embed_dropout"),
    "rotary": ("rotary_emb",),
    "embed_norm": ("word_embeddings_layernorm",),
    "project_in": ("project_in",),  # OPT's, when its embedding is narrower than its layers
    "project_out": ("project_out",),
}
STEM_ROLES = ("embed", "project_in", "positions", "dropout", "embed_norm")  # what stage 0 holds before the layers
TAIL_ROLES = ("norm", "project_out")  # what the last stage holds after the layers, before the head


@dataclass
class DecoderParts:
    """Where a causal LM keeps each piece: attribute names (in the base model, the head in the
    wrapper) and the modules."""

    names: dict[str, str]
    modules: dict[str, nn.Module]
    base: nn.Module  # the base model, whose forward may scale the embeddings (`embed_scale`)

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
    decoder = getattr(base, "decoder", None)  # OPT keeps its pieces one level down
    if not any(isinstance(getattr(base, n, None), nn.ModuleList) for n in _ROLES["layers"]) and isinstance(
        decoder, nn.Module
    ):
        base = decoder
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
    missing = [role for role in ("embed", "layers") if not names.get(role)]  # a norm is optional (OPT-350m has none)
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
    return DecoderParts(names, modules, base)


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
        self.embed_scale = stage_inputs.embed_scale(config, parts.base, parts.modules["embed"]) if first else None
        self.layers_name = parts.names["layers"]
        self.hidden_blocks = (self.layers_name,)  # what Muon trains (swarm.models.matrices)
        self.add_module(self.layers_name, nn.ModuleDict({str(i): parts.layers[i] for i in layers}))
        self.kinds = {i: stage_inputs.mask_kind(config, i) for i in layers}
        self.kind_set = set(self.kinds.values())  # the layer types whose masks and rotary a forward builds
        self.rotary = parts.modules.get("rotary") if len(layers) else None
        # Gemma 3's rotary embedding gives each layer type its own cos/sin (local and global bases)
        self.rotary_by_kind = (
            self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters
        )
        # per layer: a family may mix layer classes; one ALiBi builder per class, its bias built
        # once per forward (the same for every layer of that class, as the unsplit model's)
        builders = {type(parts.layers[i]): stage_inputs.alibi_of(config, parts.layers[i]) for i in layers}
        self.alibi = {i: builders[type(parts.layers[i])] for i in layers}
        self.layer_takes = {i: stage_inputs.arguments_of(parts.layers[i]) for i in layers}
        if last:
            for role in TAIL_ROLES:
                if role in parts.modules:
                    self.add_module(parts.names[role], parts.modules[role])
            self.add_module(parts.names["head"], head)
        self.logit_transforms = [  # (transform, its config value)
            (transform, value)
            for key, transform in stage_inputs.LOGIT_TRANSFORMS.items()
            if last and (value := getattr(config, key, None)) is not None  # 1.0 too: a soft-cap of 1 is tanh
        ]
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
            if self.embed_scale is not None:
                hidden = self.embed_scale(hidden)
            if (project_in := self._part("project_in")) is not None:
                hidden = project_in(hidden)
            if (positions := self._part("positions")) is not None:
                hidden = hidden + stage_inputs.position_embeddings(self.config, positions, position_ids)
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
            kinds = self.kind_set
            masks = stage_inputs.masks(self.config, kinds, hidden, position_ids)
            if self.rotary_by_kind:
                rotary = {kind: self.rotary(hidden, position_ids, kind) for kind in kinds}
            elif self.rotary is not None:
                rotary = dict.fromkeys(kinds, self.rotary(hidden, position_ids))
            entering = hidden  # the unsplit model builds ALiBi from the hidden states its layers start with
            biases = {}
            for index, layer in layers.items():
                i = int(index)
                arguments = {"attention_mask": masks[self.kinds[i]], "position_ids": position_ids, "use_cache": False}
                if (alibi := self.alibi[i]) is not None:
                    if alibi not in biases:
                        biases[alibi] = alibi(entering)  # [B * heads, 1, T]
                    arguments["alibi"] = biases[alibi]
                if self.rotary is not None:
                    arguments["position_embeddings"] = rotary[self.kinds[i]]
                if (takes := self.layer_takes[i]) is not None:
                    arguments = {k: v for k, v in arguments.items() if k in takes}
                out = layer(hidden, **arguments)
                hidden = out[0] if isinstance(out, tuple) else out
        if self.last:
            for role in TAIL_ROLES:
                if (part := self._part(role)) is not None:
                    hidden = part(hidden)
            hidden = self._part("head")(hidden)
            for transform, value in self.logit_transforms:
                hidden = transform(hidden, value)
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
        raise StageCountError(
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
        head = sum(_size(parts.modules.get(role)) for role in (*TAIL_ROLES, "head"))
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
