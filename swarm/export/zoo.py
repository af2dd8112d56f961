"""hivepipe's own models (digits_cnn, digits_mlp, resnet18, relay, a function of yours) out of
their stages: safetensors weights and the config that rebuilds them.

    model.safetensors     every stage's parameters and buffers, "stages.<i>.<name>" (a tied
                          parameter once, under its first stage)
    hivepipe_model.json   {"format", "model": {name, num_stages, options}, "seed", "step", "tied"}

`load_exported(DIR)` builds the model from that config and loads the weights: a `StagedModel`
in evaluation mode, which `model(inputs)` runs through all its stages in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from swarm.export.state import RunState
from swarm.models import StagedModel, TiedPair, build_model

FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "hivepipe_model.json"
_PREFIX = "stages."


def save_zoo(staged: StagedModel, run: RunState, out: Path) -> list[str]:
    """Writes the model into `out`; the lines the export prints."""
    from safetensors.torch import save_file

    seconds = {pair.second for pair in staged.tied}  # each tied parameter's copy in a later stage
    tensors = {
        f"{_PREFIX}{index}.{name}": value.detach().cpu().contiguous().clone()  # a copy: no storage shared
        for index, stage in enumerate(staged.stages)
        for name, value in stage.state_dict().items()
        if (index, name) not in seconds
    }
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "format": FORMAT,
        "model": run.cfg.model.model_dump(mode="json"),
        "seed": run.cfg.seed,
        "step": run.step,
        "tied": [[list(pair.first), list(pair.second)] for pair in staged.tied],
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return [
        f"{run.cfg.model.name} model of step {run.step} from {run.source} in {out}"
        f" ({WEIGHTS_FILE}, {CONFIG_FILE}; swarm.export.zoo.load_exported loads it)"
    ]


def load_exported(directory: str | Path) -> StagedModel:
    """The model an export wrote into `directory`, rebuilt and loaded, in evaluation mode."""
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
        model = config["model"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{directory}: not a hivepipe model export ({CONFIG_FILE}: {e})") from None
    if config.get("format") != FORMAT:
        raise ValueError(f"{directory}: export format {config.get('format')!r}, this hivepipe reads {FORMAT}")
    staged = build_model(model["name"], model["num_stages"], **model.get("options", {}))
    tensors = load_file(str(directory / WEIGHTS_FILE))
    for index, stage in enumerate(staged.stages):
        prefix = f"{_PREFIX}{index}."
        own = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
        for first, second in (TiedPair(tuple(a), tuple(b)) for a, b in config.get("tied", [])):
            if second[0] == index:
                own[second[1]] = tensors[f"{_PREFIX}{first[0]}.{first[1]}"]
        with torch.no_grad():
            stage.load_state_dict(own, strict=True)
    return staged.eval()
