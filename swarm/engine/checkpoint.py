"""A checkpoint's stage files: weights, optimizer, schedule and the compression state of the link ends.

One file per stage, `stage<i>.pt` in a checkpoint directory (`stage_file`), written to a temporary
file and renamed into place, so a crash never leaves a half-written file. Both transports write and
read this format, so either can resume the other's checkpoint. A swarm with adaptive compression
also writes `adaptive.json` beside them: the codecs its links ran (`checkpoint_codecs`).

Disk-backed AQ-SGD stores keep their rows in their memmap file (the checkpoint holds slots,
versions and a crc32 of the rows), so only the newest checkpoint of such a run can resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from swarm.engine.linkend import LinkEnds
from swarm.engine.stage import StageRuntime

FORMAT = 1
CODECS_FILE = "adaptive.json"  # in a checkpoint directory: the codecs its link state belongs to


def stage_file(directory: str | os.PathLike, stage: int) -> Path:
    return Path(directory) / f"stage{stage}.pt"


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


def frozen_names(module: torch.nn.Module) -> set[str]:
    """Parameters that never train (a LoRA run's base weights): every peer rebuilds them from the
    config, so states leave them out."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def module_state(module: torch.nn.Module) -> dict:
    frozen = frozen_names(module)
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def check_module_state(module: torch.nn.Module, saved: dict, where: str) -> None:
    """A `module_state` holds exactly the module's trainable parameters and buffers."""
    expected = set(module_state(module))
    if set(saved) != expected:
        missing, extra = sorted(expected - set(saved)), sorted(set(saved) - expected)
        raise ValueError(f"{where} does not fit the module (missing {missing[:3]}, unexpected {extra[:3]})")


def stage_state(runtime: StageRuntime, ends: LinkEnds, step: int, in_flight: bool = False) -> dict:
    """What a checkpoint of one stage holds, with `ends` as its link ends. Only a state without
    link ends may be taken with micro-batches in flight (`in_flight`): their activations and held
    gradients are not part of it, link state would be."""
    if runtime.pending and not (in_flight and ends == (None, None)):
        raise RuntimeError(
            f"stage {runtime.index} has {runtime.pending} micro-batch(es) in flight; checkpoint between steps"
        )
    return {
        "format": FORMAT,
        "stage": runtime.index,
        "num_stages": runtime.num_stages,
        "step": int(step),
        "module": module_state(runtime.module),
        "names": dict(getattr(runtime.module, "source_names", {})),
        "optimizer": runtime.optimizer.state_dict(),
        "scheduler": None if runtime.scheduler is None else runtime.scheduler.state_dict(),
        "inbound": None if ends.inbound is None else ends.inbound.state_dict(),
        "outbound": None if ends.outbound is None else ends.outbound.state_dict(),
        "delay": None if runtime.delay is None else runtime.delay.state_dict(),  # train.schedule async
    }


def read_stage(source, device="cpu") -> dict:
    """A stage checkpoint from a path or a binary file; ValueError if it is not one."""
    try:
        state = torch.load(source, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"not a stage checkpoint: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a hivepipe stage checkpoint (format {FORMAT})")
    return state


def apply_stage_state(runtime: StageRuntime, ends: LinkEnds, state: dict) -> int:
    """Loads a stage checkpoint into `runtime` and its link `ends`; returns its step."""
    if (state["stage"], state["num_stages"]) != (runtime.index, runtime.num_stages):
        raise ValueError(
            f"checkpoint is of stage {state['stage']}/{state['num_stages']}, this runtime is stage {runtime.index}/{runtime.num_stages}"
        )
    check_module_state(runtime.module, state["module"], f"checkpoint of stage {runtime.index}")  # before anything loads
    delayed = state.get("delay")  # the gradients an asynchronous schedule applies next (swarm.engine.delay)
    if (delayed is None) != (runtime.delay is None):
        ran, runs = (
            ("an asynchronous", "a synchronous") if delayed is not None else ("a synchronous", "an asynchronous")
        )
        raise ValueError(
            f"checkpoint of stage {runtime.index} is of {ran} schedule; this run has {runs} one (train.schedule)"
        )
    for name, end in zip(("inbound", "outbound"), ends, strict=True):
        saved = state[name]
        if (end is None) != (saved is None):
            raise ValueError(
                f"checkpoint of stage {runtime.index} has {'no' if saved is None else 'an'} {name} link end, the runtime {'none' if end is None else 'one'}"
            )
        if end is not None:
            end.check_state(saved)
    runtime.module.load_state_dict(state["module"], strict=False)  # frozen parameters are not in it
    runtime.optimizer.load_state_dict(state["optimizer"])
    if runtime.scheduler is not None and state["scheduler"] is not None:
        runtime.scheduler.load_state_dict(state["scheduler"])
    for name, end in zip(("inbound", "outbound"), ends, strict=True):
        if end is not None:
            end.load_state_dict(state[name])
    if runtime.delay is not None:
        runtime.delay.load_state_dict(delayed)
    runtime.clear()
    return int(state["step"])


def save_stage(runtime: StageRuntime, ends: LinkEnds, path: str | os.PathLike, step: int) -> None:
    atomic_save(stage_state(runtime, ends, step), path)


def load_stage(runtime: StageRuntime, ends: LinkEnds, path: str | os.PathLike) -> int:
    """Loads one stage's checkpoint file; returns the step it was saved at."""
    try:
        state = read_stage(path, runtime.device)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return apply_stage_state(runtime, ends, state)


def checkpoint_codecs(directory, adaptive: bool = True) -> dict | None:
    """What an adaptive run saved next to its stages' files ({"codecs": {boundary: (fw, bw)},
    "history": [...]}), or None for a checkpoint of fixed codecs. A run without adaptive
    compression (`adaptive=False`) cannot resume such a checkpoint: its links ran other codecs."""
    path = Path(directory) / CODECS_FILE
    if not path.is_file():
        return None
    if not adaptive:
        raise ValueError(
            f"checkpoint {directory} was saved by a swarm with compression.adaptive (its links ran other codecs); resume it with that config through peers.trainer or swarm lab"
        )
    try:
        saved = json.loads(path.read_text())
        codecs = {int(b): (str(fw), str(bw)) for b, (fw, bw) in saved["codecs"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {directory}: unreadable {CODECS_FILE} ({str(e).splitlines()[0][:120]})") from None
    return {"codecs": codecs, "history": list(saved.get("history", []))}
