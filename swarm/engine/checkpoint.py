"""Per-stage checkpoints: weights, optimizer, schedule and the compression state of the link ends.

One file per stage (`save_stage` / `load_stage`), written to a temporary file and renamed into
place, so a crash never leaves a half-written checkpoint. A run's checkpoint (`save_run`) is a
directory `step-<N>` holding every stage's file and the trainer's position, also renamed into
place once complete; `latest_run` finds the newest complete one.

Disk-backed AQ-SGD stores keep their rows in their memmap file (the checkpoint holds slots,
versions and a crc32 of the rows), so only the newest checkpoint of such a run can resume.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

FORMAT = 1
_RUN_DIR = re.compile(r"step-(\d+)")


def atomic_write(path: str | os.PathLike, write) -> None:
    """`write(file)` into a temporary file next to `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_save(obj, path: str | os.PathLike) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def _end_state(end) -> dict | None:
    return None if end is None else end.state_dict()


def stage_state(runtime, step: int, ends: dict | None = None) -> dict:
    """What a checkpoint of one stage holds. `ends`: extra link ends by name (a hosted stage's
    ends per neighbour), saved next to the runtime's own inbound / outbound ends."""
    if runtime.pending:
        raise RuntimeError(
            f"stage {runtime.index} has {runtime.pending} micro-batch(es) in flight; checkpoint between steps"
        )
    return {
        "format": FORMAT,
        "stage": runtime.index,
        "num_stages": runtime.num_stages,
        "step": int(step),
        "module": runtime.module.state_dict(),
        "optimizer": runtime.optimizer.state_dict(),
        "scheduler": None if runtime.scheduler is None else runtime.scheduler.state_dict(),
        "inbound": _end_state(runtime.inbound),
        "outbound": _end_state(runtime.outbound),
        "ends": {name: {key: end.state_dict() for key, end in group.items()} for name, group in (ends or {}).items()},
    }


def save_stage(runtime, path: str | os.PathLike, step: int, ends: dict | None = None) -> None:
    atomic_save(stage_state(runtime, step, ends), path)


def read_stage(path: str | os.PathLike, device="cpu") -> dict:
    state = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a hivepipe stage checkpoint (format {FORMAT})")
    return state


def apply_stage_state(runtime, state: dict) -> int:
    """Load a stage checkpoint into `runtime`; returns its step."""
    if (state["stage"], state["num_stages"]) != (runtime.index, runtime.num_stages):
        raise ValueError(
            f"checkpoint is of stage {state['stage']}/{state['num_stages']}, this runtime is stage {runtime.index}/{runtime.num_stages}"
        )
    runtime.module.load_state_dict(state["module"])
    runtime.optimizer.load_state_dict(state["optimizer"])
    if runtime.scheduler is not None and state["scheduler"] is not None:
        runtime.scheduler.load_state_dict(state["scheduler"])
    for name in ("inbound", "outbound"):
        end, saved = getattr(runtime, name), state[name]
        if (end is None) != (saved is None):
            raise ValueError(
                f"checkpoint of stage {runtime.index} has {'no' if saved is None else 'an'} {name} link end, the runtime {'none' if end is None else 'one'}"
            )
        if end is not None:
            end.load_state_dict(saved)
    runtime._saved.clear()
    return int(state["step"])


def load_stage(runtime, path: str | os.PathLike) -> int:
    """Load one stage's checkpoint file into `runtime`; returns the step it was saved at."""
    return apply_stage_state(runtime, read_stage(path, runtime.device))


# ---- a whole run (single process): one directory per checkpoint -------------------------------


def run_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def latest_run(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory in `directory` (it has trainer.pt), or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if p.is_dir() and (m := _RUN_DIR.fullmatch(p.name)) and (p / "trainer.pt").is_file()
    ]
    return max(found)[1] if found else None


def save_run(directory: str | os.PathLike, step: int, pipeline, trainer: dict, keep: int = 2) -> Path:
    """Every stage (through `pipeline.save_checkpoint`) and the trainer's position, as one
    directory renamed into place when complete; keeps the newest `keep` checkpoints."""
    directory = Path(directory)
    final = run_dir(directory, step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        pipeline.save_checkpoint(tmp, step)
        atomic_save({"format": FORMAT, "step": int(step), **trainer}, tmp / "trainer.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    runs = sorted((int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _RUN_DIR.fullmatch(p.name)))
    for _, old in runs[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_run(path: str | os.PathLike, pipeline) -> dict:
    """Load a checkpoint directory into `pipeline`; returns the trainer's saved position."""
    path = Path(path)
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    step = pipeline.load_checkpoint(path)
    if step != trainer["step"]:
        raise ValueError(f"checkpoint {path}: stages are at step {step}, the trainer at {trainer['step']}")
    return trainer
