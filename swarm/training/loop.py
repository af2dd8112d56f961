"""The training loop: train and evaluate an experiment through any `Pipeline`.

It is transport-agnostic: it feeds micro-batches to the pipeline (`swarm.engine.pipeline`), the
in-process one or the swarm's trainer side, and writes the same results rows for both.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from swarm.config import ExperimentConfig
from swarm.config.target import Target
from swarm.data import collate
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.engine.pipeline import Pipeline, Rewound
from swarm.models import summarize
from swarm.tracing import TRACER
from swarm.training.checkpoints import Checkpointing, latest_run, load_run, run_step, save_run
from swarm.training.progress import RunProgress, sample_line
from swarm.training.results import ResultsWriter
from swarm.training.sampling import PipelineSampler
from swarm.training.stamp import stamp


@dataclass(frozen=True)
class Schedule:
    steps_per_epoch: int
    total_steps: int
    eval_every_steps: int
    warmup_steps: int
    lr_horizon: int  # steps the learning-rate schedule spans (the paper's cosine used T_max = 200 epochs)

    @classmethod
    def of(cls, cfg: ExperimentConfig, train_size: int, max_steps: int | None = None) -> Schedule:
        per_epoch = train_size // cfg.train.batch_size
        if per_epoch == 0:
            raise ValueError(
                f"the training set ({train_size} samples) is smaller than one batch ({cfg.train.batch_size})"
            )
        total = max(1, math.ceil(cfg.train.epochs * per_epoch))
        for cap in (cfg.train.max_steps, max_steps):
            if cap is not None:
                total = min(total, cap)
        horizon = total
        if cfg.optimizer.schedule_epochs is not None:
            horizon = max(1, round(cfg.optimizer.schedule_epochs * per_epoch))
        elif cfg.optimizer.schedule_steps is not None:
            horizon = cfg.optimizer.schedule_steps
        return cls(
            per_epoch,
            total,
            max(1, round(cfg.train.eval_every * per_epoch)),
            round(cfg.train.warmup_epochs * per_epoch),
            horizon,
        )


def split_micro_batches(step: int, ids, inputs, targets, count: int, mode: Mode, exact: bool):
    """(MicroBatch, inputs) pairs; loss weights make the gradients add up to the batch mean.

    tensor_split gives exactly `count` pieces (chunk may give fewer), sizes differing by at most 1.
    """
    total = ids.numel()
    out = []
    pieces = zip(ids.tensor_split(count), inputs.tensor_split(count), targets.tensor_split(count), strict=True)
    for index, (i, x, y) in enumerate(pieces):
        out.append((MicroBatch(step, index, i, y, mode, i.numel() / total, exact), x))
    return out


EVAL_GROUP = 16  # evaluation micro-batches handed to the pipeline at once (a swarm overlaps them)


def eval_micro_batch_size(cfg: ExperimentConfig) -> int:
    """Evaluation runs in micro-batches no larger than training's: what fits a stage's memory in
    training fits in evaluation (a language model's logits for a whole evaluation batch of
    1024-token blocks would not), and no payload is larger than a training one."""
    return math.ceil(cfg.train.batch_size / cfg.train.micro_batches)


def evaluate(pipeline: Pipeline, cfg: ExperimentConfig, test_set, step: int, exact: bool, collate) -> dict[str, float]:
    loader = DataLoader(test_set, batch_size=cfg.train.eval_batch_size, shuffle=False, collate_fn=collate)
    size = eval_micro_batch_size(cfg)
    sums: Counter = Counter()
    group: list = []
    index = 0
    for ids, inputs, targets in loader:
        count = math.ceil(ids.numel() / size)
        for i, x, y in zip(
            ids.tensor_split(count), inputs.tensor_split(count), targets.tensor_split(count), strict=True
        ):
            group.append((MicroBatch(step, index, i, y, Mode.EVAL, 1.0, exact), x))
            index += 1
        if len(group) >= EVAL_GROUP:
            for metrics in pipeline.run_many(group):
                sums.update(metrics)
            group = []
    for metrics in pipeline.run_many(group):
        sums.update(metrics)
    return summarize(sums, perplexity=hasattr(test_set, "vocab_size"))  # token datasets: language models


def _traced(name: str, fn, *args):
    """`fn(*args)`, a span of the timeline when tracing (swarm.tracing)."""
    with TRACER.span(name, "steps"):
        return fn(*args)


def _run_many(pipeline: Pipeline, pieces: list, following: list) -> list[dict[str, float]]:
    """The step's metrics; the next step's micro-batches go along when there are (the keyword only
    then: only pipelines that run an asynchronous schedule take it)."""
    return pipeline.run_many(pieces, following=following) if following else pipeline.run_many(pieces)


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if k.endswith(".train") and v - before.get(k, 0)}


def _skip_batches(loader: DataLoader, count: int):
    """An iterator over `loader` past its first `count` batches, drawing the same random numbers
    as iterating them (in one process without loading them)."""
    batches = iter(loader)
    indices = getattr(batches, "_sampler_iter", None) if loader.num_workers == 0 else None
    for _ in range(count):
        next(indices if indices is not None else batches)
    return batches


class _Peekable:
    """An iterator that can show its next item before it is taken (the next step's batch, which an
    asynchronous schedule's pipeline starts early); `peek` is None at the end."""

    def __init__(self, items) -> None:
        self._items, self._next = iter(items), None

    def __iter__(self):
        return self

    def __next__(self):
        if self._next is not None:
            item, self._next = self._next, None
            return item
        return next(self._items)

    def peek(self):
        if self._next is None:
            self._next = next(self._items, None)
        return self._next


def train(
    cfg: ExperimentConfig,
    pipeline: Pipeline,
    data,
    results: ResultsWriter,
    max_steps: int | None = None,
    progress: bool = True,
    checkpoint: Checkpointing | None = None,
) -> dict:
    """The training loop; returns the summary row (also written to `results`).

    With `checkpoint`, it resumes from the newest complete checkpoint in its directory and saves
    new ones as it goes.
    """
    train_set, test_set = data
    schedule = Schedule.of(cfg, len(train_set), max_steps)
    if max_steps is not None and max_steps > schedule.total_steps:  # asked for more than the config has
        print(
            f"--steps {max_steps}: the config's run has {schedule.total_steps} steps (train.epochs, train.max_steps); it stops there",
            file=sys.stderr,
        )
    sampler = PipelineSampler.of(cfg, data)  # train.sample_every
    if not any(row.get("type") == "config" for row in results.rows):  # a resumed run's file has it
        results.write(
            {
                "type": "config",
                "name": cfg.name,
                "config": cfg.model_dump(mode="json"),
                "started": datetime.datetime.now(datetime.UTC).isoformat(),
                "stamp": stamp(),
            }
        )
    generator = torch.Generator().manual_seed(cfg.seed)
    target = Target.parse(cfg.train.target) if cfg.train.target else None
    if target is not None and not len(test_set):
        raise ValueError(f"train.target {target}: the test split is empty, so no evaluation can reach it")
    reached = False
    step, samples, epoch, done_in_epoch, elapsed = 0, 0, 0, 0, 0.0
    evals: list[dict] = []

    def go_to(state: dict, whence: str) -> None:
        """Carries on from a saved position (a checkpoint's, or one the swarm kept)."""
        nonlocal step, samples, epoch, done_in_epoch, elapsed
        step, samples, epoch, done_in_epoch = state["step"], state["samples"], state["epoch"], state["batch"]
        elapsed = state["time_s"]
        generator.set_state(state["generator"])
        torch.set_rng_state(state["rng"])
        evals[:] = json.loads(state["evals"])
        print(f"{whence} at step {step}", file=sys.stderr)

    resumed = pipeline.resumed()  # a restarted trainer: the swarm kept the run's position
    latest = latest_run(checkpoint.directory) if checkpoint is not None else None
    if latest is not None and (resumed is None or run_step(latest) > resumed["step"]):
        go_to(load_run(latest, pipeline), f"resuming from checkpoint {latest}")
    elif resumed is not None:
        go_to(resumed, "resuming from the copies the swarm kept")
    if target is not None and evals and evals[-1]["step"] == step:  # resumed at an evaluation: its target may differ
        target.require_reported(evals[-1]["uncompressed"])
        reached = target.reached(evals[-1]["uncompressed"])
    started = time.perf_counter() - elapsed
    bytes_before: dict[str, int] = pipeline.link_bytes() if step else {}
    bar = tqdm(
        total=schedule.total_steps, initial=step, desc=cfg.name, unit="step", disable=not progress, dynamic_ncols=True
    )
    pace = RunProgress(schedule.total_steps)  # the bar's samples/s (over the last steps)
    shown: dict[str, float] = {}  # the bar's postfix: samples/s, then the last evaluation's metrics

    def run_eval() -> dict:
        row = {"type": "eval", "step": step, "epoch": step / schedule.steps_per_epoch}
        began = time.perf_counter()
        row["uncompressed"] = evaluate(pipeline, cfg, test_set, step, True, collate)
        if cfg.train.eval_compressed:
            row["compressed"] = evaluate(pipeline, cfg, test_set, step, False, collate)
        # its own duration, so that training time can leave evaluations out (bench time-to-target)
        row["time_s"], row["eval_s"] = time.perf_counter() - started, time.perf_counter() - began
        evals.append(row)
        results.write(row)
        shown.update({k: round(v, 4) for k, v in row["uncompressed"].items()})
        bar.set_postfix(shown)
        if sampler is not None and sampler.due(len(evals)):
            sampled = sampler.sample(pipeline, step)
            results.write(sampled)
            if progress:  # else the rows' listeners print (the trainer's progress lines)
                bar.write(sample_line(sampled), file=sys.stderr)
        return row

    def ahead(after: int, batches: _Peekable) -> list:
        """An asynchronous schedule's next step, started with this one's micro-batches unless the
        pipeline drains at `after` (an evaluation, a checkpoint, the epoch's or the run's end, or what
        the transport needs: `Pipeline.drains`): its micro-batches only need the step before this one
        applied (swarm.engine.delay)."""
        evaluated = after % schedule.eval_every_steps == 0 or after >= schedule.total_steps
        saved = checkpoint is not None and (after % checkpoint.every == 0 if checkpoint.every else evaluated)
        drained = pipeline.drains(after)  # e.g. the swarm's copies are of a drained pipeline too
        following = None if evaluated or saved or drained else batches.peek()
        if following is None:
            return []
        exact = after < schedule.warmup_steps
        return split_micro_batches(after, *following, cfg.train.micro_batches, Mode.TRAIN, exact)

    def position(epoch_start: torch.Tensor) -> dict:
        """What resumes the loop at this step boundary (with the stages' state of the same step)."""
        return {
            "step": step,
            "epoch": epoch,
            "batch": done_in_epoch,
            "generator": epoch_start,
            "rng": torch.get_rng_state(),
            "samples": samples,
            "evals": json.dumps(evals),
            "time_s": time.perf_counter() - started,
        }

    while step < schedule.total_steps and not reached:
        if hasattr(train_set, "set_epoch"):
            train_set.set_epoch(epoch)
        epoch_start = generator.get_state()  # what replays this epoch's order on resume
        loader = DataLoader(
            train_set,
            batch_size=cfg.train.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
            collate_fn=collate,
        )
        batches = _Peekable(_skip_batches(loader, done_in_epoch))
        for ids, inputs, targets in batches:
            try:
                pipeline.snapshot(step, position(epoch_start))
                done_in_epoch += 1
                exact = step < schedule.warmup_steps
                pieces = split_micro_batches(step, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, exact)
                following = ahead(step + 1, batches) if cfg.train.schedule == "async" else ()
                losses = [
                    metrics["loss"] * batch.weight
                    for (batch, _), metrics in zip(
                        pieces, _traced(f"micro-batches {step}", _run_many, pipeline, pieces, following), strict=True
                    )
                ]
                lr = _traced(f"step {step}", pipeline.step)
                step += 1
                samples += ids.numel()
                now = pipeline.link_bytes()
                notes = pipeline.step_notes()  # a swarm's adaptive codecs, its stages' compute
                row = {
                    "type": "step",
                    "step": step,
                    "epoch": step / schedule.steps_per_epoch,
                    "loss": sum(losses),
                    "lr": lr,
                    "samples": samples,
                    "exact": exact,
                    "bytes": _delta(now, bytes_before),
                    "time_s": time.perf_counter() - started,
                    "at": time.time(),
                    **notes,
                }
                results.write(row)
                pace.observe(row)
                bytes_before = now
                bar.update(1)
                bar.set_description(f"{cfg.name} loss {sum(losses):.4f}")
                shown["samples/s"] = round(pace.samples_per_s, 1)
                bar.set_postfix(shown)
                evaluated = step % schedule.eval_every_steps == 0 or step == schedule.total_steps
                measured = _traced(f"evaluate at {step}", run_eval)["uncompressed"] if evaluated else None
                reached = measured is not None and target is not None and target.reached(measured)
                if checkpoint is not None and (step % checkpoint.every == 0 if checkpoint.every else evaluated):
                    save_run(checkpoint.directory, step, pipeline, position(epoch_start), checkpoint.keep, cfg)
                if measured is not None and target is not None:
                    target.require_reported(measured)  # after the checkpoint: a resumed run loses nothing
            except Rewound as rewound:  # a stage was lost: its steps since the swarm's copies run again
                go_to(rewound.position, f"going back to the copies the swarm kept, from step {step}")
                results.rewind(step)
                bytes_before = pipeline.link_bytes()
                bar.n = step
                bar.refresh()
                break  # the epoch of that position starts over (its order replayed, its done batches skipped)
            if step >= schedule.total_steps or reached:
                break
        else:
            epoch, done_in_epoch = epoch + 1, 0
    bar.close()
    totals = {k.removesuffix(".train"): v for k, v in pipeline.link_bytes().items() if k.endswith(".train")}
    summary = {
        "type": "summary",
        "name": cfg.name,
        "steps": step,
        "samples": samples,
        "wall_time_s": time.perf_counter() - started,
        "bytes": totals,
        "bytes_per_sample": {k: v / max(samples, 1) for k, v in totals.items()},
        "state_bytes": pipeline.state_bytes(),
        "final": evals[-1] if evals else None,
        "best": {
            mode: max(
                (e[mode] for e in evals if mode in e),
                key=lambda m: m.get("accuracy", -m.get("loss", 0.0)),
                default=None,
            )
            for mode in ("uncompressed", "compressed")
        },
        **({"target": str(target), "reached": reached} if target is not None else {}),
        **pipeline.summary_notes(),
    }
    results.write(summary)
    return summary
