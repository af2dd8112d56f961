"""An export from a run's state (`RunState`: a checkpoint's, a live swarm's copies, a finished
run's stages): a transformers directory for a transformers or GPT-2 model (swarm.export.decoder),
safetensors and a config for the others (swarm.export.zoo), then the Hub if asked."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from swarm.config import ExperimentConfig
from swarm.engine.pipeline import Pipeline
from swarm.export import hub
from swarm.export.decoder import save_decoder
from swarm.export.rebuild import rebuild
from swarm.export.state import RunState, stage_files_state
from swarm.export.zoo import save_zoo


@dataclass(frozen=True)
class ExportOptions:
    """Where the export goes (`out`), whether a LoRA run's adapters are merged into the base
    (`merge`), and the Hub repository it is pushed to (`push_to_hub`)."""

    out: Path
    merge: bool = False
    push_to_hub: str | None = None

    def check(self) -> None:
        """ValueError in one line for options that cannot work, before anything is exported."""
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {self.out}: a file is there, not a directory")
        if self.push_to_hub is not None:
            hub.check_repo(self.push_to_hub)


def export_run(run: RunState, options: ExportOptions) -> list[str]:
    """Writes `run`'s model into `options.out`; the lines to print (what was written, from where)."""
    options.check()
    model = run.cfg.model
    if options.merge and (model.name != "transformers" or model.options.get("lora") is None):
        raise ValueError(f"--merge: this run's model ({model.name}) trained no LoRA adapters to merge")
    staged = rebuild(run)
    options.out.mkdir(parents=True, exist_ok=True)
    if staged.whole is not None and hasattr(staged.whole, "save_pretrained"):
        lines = save_decoder(staged, run, options.out, options.merge)
    else:
        lines = save_zoo(staged, run, options.out)
    if options.push_to_hub is not None:
        lines.append(hub.push(options.out, options.push_to_hub))
    return lines


def export_pipeline(pipeline: Pipeline, cfg: ExperimentConfig, step: int, options: ExportOptions) -> list[str]:
    """At a run's end: every stage's state as the pipeline checkpoints it (a swarm's trainer fetches
    it from its stage peers), exported."""
    options.check()
    with tempfile.TemporaryDirectory(prefix="hivepipe-export-") as directory:
        pipeline.save_checkpoint(directory, step)
        run = stage_files_state(directory, cfg, step, f"the run's stages at step {step}")
        return export_run(run, options)
