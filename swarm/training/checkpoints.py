"""A run's checkpoints: one directory `step-<N>` per checkpoint, holding every stage's file
(`swarm.engine.checkpoint`, written by the pipeline) and the trainer's position, renamed into
place once complete; `latest_run` finds the newest complete one."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import ExperimentConfig
from swarm.engine.checkpoint import FORMAT, atomic_save
from swarm.engine.pipeline import Pipeline

_RUN_DIR = re.compile(r"step-(\d+)")
EXPERIMENT_FILE = "experiment.json"  # in a checkpoint directory: the run's config


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often `train` checkpoints every stage and its own position."""

    directory: str
    every: int | None = None  # steps between checkpoints; None: after every evaluation
    keep: int = 2  # newest checkpoints kept


def run_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def _runs(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _RUN_DIR.fullmatch(p.name)))


def run_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint directory `step-<N>`."""
    return int(_RUN_DIR.fullmatch(Path(path).name).group(1))


def latest_run(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory in `directory` (it has trainer.pt), or None."""
    complete = [path for _, path in _runs(Path(directory)) if (path / "trainer.pt").is_file()]
    return complete[-1] if complete else None


def save_run(
    directory: str | os.PathLike,
    step: int,
    pipeline: Pipeline,
    trainer: dict,
    keep: int = 2,
    cfg: ExperimentConfig | None = None,
) -> Path:
    """Every stage (through `pipeline.save_checkpoint`) and the trainer's position, as one
    directory renamed into place when complete; keeps the newest `keep` checkpoints. With the
    run's `cfg`, the directory also holds it (`EXPERIMENT_FILE`: what rebuilds the model, for
    `python -m swarm export`), and a LoRA run's adapters as a peft directory, `adapter/`."""
    directory = Path(directory)
    final = run_dir(directory, step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    options = cfg.model.options if cfg is not None and cfg.model.name == "transformers" else {}
    lora = options.get("lora")
    try:
        pipeline.save_checkpoint(tmp, step)
        if cfg is not None:
            (tmp / EXPERIMENT_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
        if lora is not None:
            from swarm.models.lora import ADAPTER_DIR, write_adapters  # LoRA runs only: peft is heavy

            stages = sorted(tmp.glob("stage*.pt"), key=lambda p: int(p.stem.removeprefix("stage")))
            # mapped, not read: a stage file also holds its links' state (AQ-SGD tables can be large)
            states = [torch.load(p, map_location="cpu", weights_only=True, mmap=True) for p in stages]
            write_adapters(states, lora, options.get("pretrained"), tmp / ADAPTER_DIR)
        atomic_save({"format": FORMAT, "step": int(step), **trainer}, tmp / "trainer.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, old in _runs(directory)[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_run(path: str | os.PathLike, pipeline: Pipeline) -> dict:
    """Loads a checkpoint directory into `pipeline`; returns the trainer's saved position."""
    path = Path(path)
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    step = pipeline.load_checkpoint(path)
    if step != trainer["step"]:
        raise ValueError(f"checkpoint {path}: stages are at step {step}, the trainer at {trainer['step']}")
    return trainer
