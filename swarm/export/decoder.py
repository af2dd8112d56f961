"""A transformers causal LM out of its stages, as a directory Hugging Face's loaders read.

The stages share the modules of the unsplit model they were cut from (`StagedModel.whole`), so
once the run's weights are in the stages the unsplit model holds them: `save_pretrained` writes
its config and safetensors weights, a tied LM head once (the last stage's own copy equals the
embedding: `rebuild` checks it). Beside them: the tokenizer the data named and a generation config
whose special tokens are the tokenizer's (a model built from `options.config` has only its
family's defaults; a pretrained model keeps its own).

A LoRA run gives peft's adapter directory (adapter_config.json, adapter_model.safetensors), which
`PeftModel.from_pretrained(base, DIR)` loads onto its base model, or with `merge` the adapters
merged into the base weights: a plain model directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from swarm.data.tokenizer import data_tokenizer
from swarm.export.state import RunState
from swarm.models import StagedModel
from swarm.models.lora import write_adapters

log = logging.getLogger(__name__)
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_of(run: RunState) -> tuple[object | None, str]:
    """The data's tokenizer and what the export says of it (it may not load here: a relative path
    read from another directory, a hub name offline; the model is written without it then)."""
    data = run.cfg.data
    try:
        tokenizer = data_tokenizer(data.name, data.options)
    except ValueError as e:
        return None, f"no tokenizer written: {e}"
    if tokenizer is None:
        return None, f"no tokenizer written: data {data.name} names none"
    if data.options.get("tokenizer") == "bytes":
        return tokenizer, "tokenizer: ByT5's UTF-8 bytes (data.options.tokenizer: bytes; its config files only)"
    return tokenizer, f"tokenizer: {data.options.get('tokenizer', 'gpt2')}"


def merge_adapters(model) -> None:
    """peft's LoRA layers in `model` merged into the weights they wrap, and replaced by them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=True)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())


def _special_tokens(model, tokenizer) -> None:
    """The tokenizer's special tokens in the model's config and generation config."""
    for key in SPECIAL_TOKENS:
        value = getattr(tokenizer, key, None)
        setattr(model.config, key, value)
        if model.generation_config is not None:
            setattr(model.generation_config, key, value)


def _base_name(pretrained) -> str:
    """The base model as an adapter config names it: a hub name, or a directory made absolute."""
    path = Path(str(pretrained)).expanduser()
    return str(path.resolve()) if path.exists() else str(pretrained)


def save_decoder(staged: StagedModel, run: RunState, out: Path, merge: bool) -> list[str]:
    """Writes the model (or its adapter) into `out`; the lines the export prints."""
    options = run.cfg.model.options
    lora = options.get("lora") if run.cfg.model.name == "transformers" else None
    pretrained = options.get("pretrained")
    tokenizer, said = tokenizer_of(run)
    if lora is not None and not merge:
        if pretrained is None:
            raise ValueError(
                "export: this LoRA run's base was built from model.options.config, weights no loader can find: export with --merge"
            )
        write_adapters(run.stages, lora, _base_name(pretrained), out)
        written = f"peft LoRA adapter of step {run.step} for base {_base_name(pretrained)} (PeftModel.from_pretrained)"
    else:
        model = staged.whole
        if lora is not None:
            merge_adapters(model)
        if tokenizer is not None and pretrained is None:
            _special_tokens(model, tokenizer)
        model.save_pretrained(out)
        kind = "merged with its LoRA adapters " if lora is not None else ""
        written = f"{model.config.model_type} model of step {run.step} {kind}(AutoModelForCausalLM.from_pretrained)"
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return [f"{written} from {run.source} in {out}", said]
