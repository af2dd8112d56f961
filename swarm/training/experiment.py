"""An experiment from its config to its results: data, results files, and the single-process run
(`python -m swarm run CONFIG`); the swarm's trainer (peers.trainer) uses the same pieces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.config import ExperimentConfig
from swarm.data import build_datasets
from swarm.engine.pipeline import Pipeline
from swarm.training.checkpoints import Checkpointing, latest_run, run_step
from swarm.training.loop import Schedule, train
from swarm.training.results import STEPPED, ResultsWriter, read_results
from swarm.transport.local import build_local_pipeline


def build_data(cfg: ExperimentConfig):
    """The config's (train, test) datasets; token ids beyond a language model's vocabulary, and
    classes beyond a classifier's outputs, are refused here, in one line, rather than as an index
    error inside a stage or the loss."""
    from swarm.models.registry import model_num_classes, model_vocab_size  # they import transformers: data first

    data = build_datasets(cfg.data.name, data_dir=cfg.data.data_dir, seed=cfg.seed, **cfg.data.options)
    classes = getattr(data[0], "num_classes", None)
    outputs = model_num_classes(cfg.model.name, cfg.model.options)
    if isinstance(classes, int) and outputs is not None and classes > outputs:
        raise ValueError(
            f"data: {cfg.data.name} has {classes} classes but the model {cfg.model.name} has {outputs} outputs"
            f" (set model.options.num_classes: {classes})"
        )
    vocab = model_vocab_size(cfg.model.name, cfg.model.options)
    blocks = [getattr(split, "blocks", None) for split in data]
    highest = max((int(b.max()) for b in blocks if isinstance(b, torch.Tensor) and b.numel()), default=-1)
    if vocab is not None and highest >= vocab:
        raise ValueError(
            f"data: token id {highest} does not fit the model's vocabulary of {vocab}"
            " (the tokenizer is not the model's: set the model's vocab_size or use its tokenizer)"
        )
    return data


def describe(summary: dict, results_path=None) -> list[str]:
    """What a finished run prints: steps, time and the final metrics (and where results went)."""
    final = summary.get("final") or {}
    parts = [f"{summary['steps']} steps in {summary['wall_time_s']:.1f}s"]
    for mode in ("uncompressed", "compressed"):
        if final.get(mode):
            parts.append(f"{mode}: " + ", ".join(f"{k} {v:.4f}" for k, v in final[mode].items()))
    if any(mode in final for mode in ("uncompressed", "compressed")) and len(parts) == 1:
        parts.append("no metrics from the evaluations (is the test split empty?)")
    return ["; ".join(parts)] + ([f"results written to {results_path}"] if results_path else [])


def _rows_until(results_path, step: int) -> list[dict]:
    """A resumed run's results so far: the config and the step and eval rows up to `step`."""
    try:
        rows = read_results(results_path)
    except (OSError, ValueError):
        return []
    return [r for r in rows if r["type"] == "config" or (r["type"] in STEPPED and r.get("step", 0) <= step)]


def open_results(
    results_path,
    checkpoint: Checkpointing | None = None,
    writer=ResultsWriter,
    resumed: int | None = None,
    listeners=(),
) -> ResultsWriter:
    """The results file of a run; one that resumes from a checkpoint, or at step `resumed` from the
    copies a swarm kept, keeps its rows up to the newer of the two (where `train` goes on from).
    `listeners` see every row, the kept ones too."""
    steps = [] if resumed is None else [resumed]
    if checkpoint is not None and (latest := latest_run(checkpoint.directory)) is not None:
        steps.append(run_step(latest))
    kept = _rows_until(results_path, max(steps)) if steps and results_path is not None else []
    results = writer(results_path)
    results.listeners.extend(listeners)
    results.keep(kept)
    return results


@dataclass
class RunHooks:
    """What a caller adds to a run: listeners of its results rows (TensorBoard's event files), and
    what runs once it finished, with its pipeline and summary (an export of the trained model)."""

    listeners: list[Callable[[dict], None]] = field(default_factory=list)
    finished: Callable[[Pipeline, dict], None] | None = None


def run_experiment(
    cfg: ExperimentConfig,
    results_path=None,
    max_steps: int | None = None,
    progress: bool = True,
    checkpoint: Checkpointing | None = None,
    hooks: RunHooks | None = None,
) -> dict:
    """Single-process run: the in-process transport. With `checkpoint`, resumes and saves."""
    if cfg.compression.adaptive is not None:
        raise ValueError(
            "compression.adaptive needs the swarm (python -m swarm lab, or peers.trainer): one process has no links to measure"
        )
    data = build_data(cfg)
    schedule = Schedule.of(cfg, len(data[0]), max_steps)
    pipeline, _ = build_local_pipeline(cfg, schedule.lr_horizon, capacity=len(data[0]))
    hooks = hooks or RunHooks()
    results = open_results(results_path, checkpoint, listeners=hooks.listeners)
    try:
        summary = train(cfg, pipeline, data, results, max_steps, progress, checkpoint)
    finally:
        results.close()
    if hooks.finished is not None:
        hooks.finished(pipeline, summary)
    return summary
