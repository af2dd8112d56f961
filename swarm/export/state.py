"""A run's state to export: its config, its step and every stage's saved state (stage files of
swarm.engine.checkpoint), from a checkpoint directory or from stage files a pipeline just wrote."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from swarm.config import ConfigError, ExperimentConfig
from swarm.engine.checkpoint import read_stage, stage_file
from swarm.training.checkpoints import EXPERIMENT_FILE, latest_run, run_step


@dataclass(frozen=True)
class RunState:
    """`stages[i]`: stage i's saved state (its "module" holds the trained parameters and buffers)."""

    cfg: ExperimentConfig
    step: int
    stages: list[dict]
    source: str  # where it came from, as the export says it


def stage_files_state(directory: str | Path, cfg: ExperimentConfig, step: int, source: str) -> RunState:
    """Every stage's file in `directory`, each of step `step` (ValueError in one line if not)."""
    stages = []
    for index in range(cfg.model.num_stages):
        path = stage_file(directory, index)
        if not path.is_file():
            raise ValueError(f"{source}: no {path.name} ({cfg.model.num_stages} stages)")
        try:
            state = read_stage(path)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if (state["stage"], int(state["step"])) != (index, step):
            raise ValueError(
                f"{path}: a state of stage {state['stage']} at step {state['step']}, not {index} at {step}"
            )
        stages.append(state)
    return RunState(cfg, step, stages, source)


def _saved_config(step_dir: Path) -> ExperimentConfig:
    path = step_dir / EXPERIMENT_FILE
    if not path.is_file():
        raise ValueError(
            f"{step_dir} holds no {EXPERIMENT_FILE} (a checkpoint of an older hivepipe): pass the run's --config"
        )
    try:
        return ExperimentConfig.model_validate(json.loads(path.read_text()))
    except ValueError as e:
        raise ConfigError(f"{path}: not a run's config ({str(e).splitlines()[0]})") from None


def checkpoint_state(path: str | Path, cfg: ExperimentConfig | None = None) -> RunState:
    """The newest complete checkpoint in a checkpoint directory (`--checkpoint_dir`), or the
    checkpoint `path` names (a step-<N> directory); `cfg`: the run's, else the one it saved."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    step_dir = path if (path / "trainer.pt").is_file() else latest_run(path)
    if step_dir is None:
        raise ValueError(f"{path} holds no complete checkpoint (a step-<N> directory with trainer.pt)")
    try:
        step = run_step(step_dir)
    except AttributeError:  # a directory with trainer.pt not named step-<N>
        raise ValueError(f"{step_dir}: a checkpoint directory is named step-<N>") from None
    return stage_files_state(step_dir, cfg or _saved_config(step_dir), step, f"checkpoint {step_dir}")
