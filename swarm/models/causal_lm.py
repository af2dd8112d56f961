"""`model: {name: transformers}`: any Hugging Face causal-LM decoder, pretrained or from a config.

    options: {pretrained: PATH_OR_HUB_NAME}            weights and config from a directory / the Hub
    options: {config: {model_type: llama, ...}}       a fresh model under the run's seed
    options.split: [3, 6, 9]                           the layer where each stage after the first starts
    options.lora: {r: 8, alpha: 16, targets: [...]}    adapters only are trained (swarm.models.lora)

A model is built only if its stages compute what the unsplit model computes on a probe input:
families outside `decoders.CHECKED_FAMILIES` may scale embeddings or add parts in their forward
that a split does not know about, and a config the model cannot run fails here in one line rather
than inside a stage peer.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.config.messages import library_message
from swarm.models.base import StagedModel, config_errors, language_model
from swarm.models.decoders import CHECKED_FAMILIES, cut_decoder
from swarm.models.lora import add_lora


def make_config(config: dict[str, Any]):
    """A transformers config from {model_type: ..., other keys}; unknown keys are refused (a
    transformers config would keep a misspelt key silently)."""
    from transformers import AutoConfig

    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError("transformers: options.config must be a mapping with a model_type (e.g. llama)")
    kwargs = dict(config)
    model_type = kwargs.pop("model_type")
    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except (ValueError, KeyError) as e:
        raise ValueError(f"transformers: unknown model_type {model_type!r} ({library_message(e)})") from None
    known = set(defaults)
    vocab = kwargs.get("vocab_size", defaults.get("vocab_size"))
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # defaults outside a small vocabulary
        default = defaults.get(token)
        if token not in kwargs and isinstance(default, int) and isinstance(vocab, int) and default >= vocab:
            kwargs[token] = None
    try:
        built = AutoConfig.for_model(model_type, **kwargs)
    except config_errors() as e:
        raise ValueError(f"transformers: bad {model_type} config ({library_message(e)})") from None
    # a key the config neither knows nor consumed (legacy keys such as rope_theta are folded into
    # others) stays on it as a bare attribute: a misspelling transformers would keep silently
    unknown = sorted(k for k in set(kwargs) - known - {"attn_implementation"} if k in built.to_dict())
    if unknown:
        raise ValueError(f"transformers: {model_type} config has no key(s) {', '.join(unknown)}")
    return built


def vocab_size(pretrained: str | None = None, config: dict | None = None, **_) -> int | None:
    """The model's vocabulary size from its options, without building it (None if unknown)."""
    from transformers import AutoConfig

    try:
        if pretrained is not None:
            return int(AutoConfig.from_pretrained(str(pretrained)).vocab_size)
        if isinstance(config, dict) and isinstance(config.get("model_type"), str):
            return int(config.get("vocab_size") or AutoConfig.for_model(config["model_type"]).vocab_size)
    except (OSError, KeyError, AttributeError, *config_errors()):  # building the model says what, in one line
        return None
    return None


def load_model(pretrained: str | None, config: dict | None, attn_implementation: str | None):
    """The unsplit causal LM in float32 (training keeps fp32 weights; `train.precision` autocasts)."""
    from transformers import AutoModelForCausalLM

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if (pretrained is None) == (config is None):
        raise ValueError("transformers: give exactly one of options.pretrained (a path or hub name) and options.config")
    try:
        if pretrained is not None:
            return AutoModelForCausalLM.from_pretrained(str(pretrained), dtype=torch.float32, **extra)
        return AutoModelForCausalLM.from_config(make_config(config), dtype=torch.float32, **extra)
    except ValueError as e:
        if str(e).startswith("transformers:"):
            raise
        raise ValueError(
            f"transformers: cannot build {pretrained or config.get('model_type')!r} ({library_message(e)})"
        ) from None
    except (OSError, KeyError, RuntimeError, ImportError, *config_errors()) as e:  # ImportError: flash_attn, ...
        raise ValueError(
            f"transformers: cannot load {pretrained or config.get('model_type')!r} ({library_message(e)})"
        ) from None


def _heads_hint(config) -> str:
    """The likeliest cause of a config that does not run: attention heads that do not divide the
    hidden size (when the family derives each head's width from it; the error is a shape mismatch)."""
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads):
        return ""
    # families that give each head hidden_size // heads set head_dim to it (or leave it unset)
    if getattr(config, "head_dim", None) not in (None, hidden // heads):
        return ""
    return f": hidden_size {hidden} is not a multiple of num_attention_heads {heads}"


def check_split(model, staged: StagedModel) -> None:
    """Refuse a family whose stages do not compute what the unsplit model computes (on 8 tokens)."""
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    probe = torch.randint(0, vocab, (1, 8), generator=generator)
    modes = [m.training for m in staged.stages]
    model.eval()
    model_type = model.config.model_type
    attention = model.config._attn_implementation
    if attention not in ("eager", "sdpa"):  # flash kernels need a GPU and half precision: probe with sdpa
        model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            try:
                whole = model(input_ids=probe).logits
            except Exception as e:  # a config the model itself cannot run
                raise ValueError(
                    f"transformers: {model_type} does not run{_heads_hint(model.config)}"
                    f" ({type(e).__name__}: {library_message(e)})"
                ) from None
            try:
                split = staged.eval()(probe)
            except Exception as e:  # a layer that wants more than a split gives it
                raise ValueError(
                    f"transformers: {model_type} cannot run split ({type(e).__name__}: {library_message(e)});"
                    f" families checked: {', '.join(CHECKED_FAMILIES)}"
                ) from None
    finally:
        for stage, mode in zip(staged.stages, modes, strict=True):
            stage.train(mode)
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
    # near-exact: the split runs the same operations (the checked families give equal bits), and a
    # random model's small logits hide output transforms (soft-capping) from a looser tolerance
    if whole.shape != split.shape or not torch.allclose(whole, split, rtol=1e-6, atol=1e-7):
        difference = (whole - split).abs().max() if whole.shape == split.shape else float("nan")
        raise ValueError(
            f"transformers: {model_type} computes something else when split (largest difference"
            f" {float(difference):.2e}); families checked: {', '.join(CHECKED_FAMILIES)}"
        )


def build_transformers(
    num_stages: int,
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    split: list[int] | None = None,
    lora: dict[str, Any] | None = None,
    attn_implementation: str | None = None,
) -> StagedModel:
    """A causal LM cut into `num_stages` stages, with a causal-LM loss (labels = inputs, shifted)."""
    model = load_model(pretrained, config, attn_implementation)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"transformers: {model.config.model_type} is an encoder-decoder; only decoders split here")
    if getattr(model.config, "layerdrop", 0.0):  # OPT's: layers skipped at random in training
        raise ValueError(f"transformers: {model.config.model_type} with layerdrop set is not supported")
    model.train()
    # with LoRA the embedding is frozen: stage 0 with a layer (adapters) makes the gradient sent back to it useful
    stages, tied = cut_decoder(model, num_stages, split, first_layers=1 if lora is not None else 0)
    staged = language_model(list(stages), model.config.vocab_size, tied, model)
    check_split(model, staged)  # every family, every config: a few ms for small models, seconds for 7B
    if lora is not None:
        add_lora(model, staged, lora)
    return staged
