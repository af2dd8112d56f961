"""LoRA adapters (through peft) on a staged decoder: only the adapters train.

`model.options.lora: {r: 8, alpha: 16, targets: [q_proj, v_proj], dropout: 0.0}` injects peft's
LoRA layers into the unsplit model before its stages are used (the stages share its modules), and
freezes every other parameter. Optimizers then hold only adapter state, checkpoints and the
copies stage peers exchange hold only adapter weights (`swarm.engine.checkpoint`), and replicas
sum only adapter gradients.

`write_adapters` turns the stages' saved adapter weights into a peft adapter directory
(adapter_config.json + adapter_model.safetensors), which `peft.PeftModel.from_pretrained(base,
DIR)` loads onto the pretrained model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from swarm.config.messages import library_message

ADAPTER_DIR = "adapter"  # in a checkpoint directory of a LoRA run
_KEYS = {"r", "alpha", "targets", "dropout"}
_ADAPTER = "default"  # peft's adapter name inside the modules


def _options(lora: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(lora, dict):
        raise ValueError(f"lora: expected a mapping like {{r: 8, alpha: 16, targets: [q_proj, v_proj]}}, got {lora!r}")
    unknown = sorted(set(lora) - _KEYS)
    if unknown:
        raise ValueError(f"lora: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    r = lora.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"lora: r must be a positive integer, got {r!r}")
    alpha = lora.get("alpha", 2 * r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"lora: alpha must be a positive number, got {alpha!r}")
    dropout = lora.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora: dropout must be in [0, 1), got {dropout!r}")
    targets = lora.get("targets")
    if targets is not None and (
        not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets)
    ):
        raise ValueError(f"lora: targets must be a list of module names (e.g. [q_proj, v_proj]), got {targets!r}")
    return {"r": r, "alpha": alpha, "dropout": float(dropout), "targets": targets}


def lora_config(lora: dict[str, Any], model_type: str, base: str | None = None):
    """peft's LoraConfig for these options (default targets: peft's for the family)."""
    try:
        from peft import LoraConfig
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS
    except ImportError as e:
        raise ValueError(f"lora: needs peft (pip install peft): {e}") from None
    options = _options(lora)
    targets = options["targets"] or DEFAULT_TARGETS.get(model_type)
    if not targets:
        raise ValueError(f"lora: no default targets for {model_type}; set lora.targets (module names, e.g. q_proj)")
    return LoraConfig(
        r=options["r"],
        lora_alpha=options["alpha"],
        lora_dropout=options["dropout"],
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def add_lora(model: nn.Module, staged, lora: dict[str, Any]) -> None:
    """Adapters into `model` (shared with `staged`'s stages); everything else frozen."""
    from peft import inject_adapter_in_model

    from swarm.models.decoders import name_sources

    config = lora_config(lora, model.config.model_type)
    # the embedding, final norm and head sit in the stages themselves: an adapter peft put around
    # them in the unsplit model would never reach a stage
    outside = sorted({name for stage in staged.stages for name in stage.roles.values()} & set(config.target_modules))
    if outside:
        raise ValueError(f"lora: targets {', '.join(outside)} are not supported (adapters go on the layers' modules)")
    try:
        inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
    except ValueError as e:
        raise ValueError(f"lora: {library_message(e)}") from None
    for stage in staged.stages:
        for name, p in stage.named_parameters():
            p.requires_grad_("lora_" in name)
    name_sources(model, staged.stages)
    # a frozen tied pair never gets a gradient: its copies stay equal with nothing to sum
    staged.tied = [
        pair for pair in staged.tied if staged.stages[pair.first[0]].get_parameter(pair.first[1]).requires_grad
    ]
    if not any(p.requires_grad for stage in staged.stages for p in stage.parameters()):
        raise ValueError(f"lora: no module of the stages matches targets {config.target_modules}")


def adapter_names(source_names: dict[str, str]) -> dict[str, str]:
    """Stage parameter name -> the key peft saves it under (base_model.model.<name>, no adapter name)."""
    out = {}
    for name, source in source_names.items():
        if "lora_" in name:
            out[name] = "base_model.model." + source.replace(f".{_ADAPTER}.", ".")
    return out


def write_adapters(states: list[dict], lora: dict[str, Any], base: str | None, directory) -> Path:
    """A peft adapter directory from the stages' saved states (`stage_state` dicts with "names");
    its target modules are those the adapters sit on."""
    from safetensors.torch import save_file

    tensors = {}
    for state in states:
        renamed = adapter_names(state.get("names") or {})
        for name, value in state["module"].items():
            if name in renamed:
                tensors[renamed[name]] = value.detach().cpu().contiguous()
    if not tensors:
        raise ValueError("lora: the stages' states hold no adapter weights")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    config = lora_config({**lora, "targets": targets}, "", base).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    return directory
