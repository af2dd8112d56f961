"""`python -m swarm bench time-to-target CONFIG --bandwidth RATES --delay D --codecs SPECS --target
METRIC=VALUE`: how long until a shaped swarm's evaluation reaches the target, per codec and bandwidth.

Each point trains the config in the lab (bootstrap, stage peers and trainer as processes on shaped
links; `torch:gloo` runs the same stages over torch.distributed instead, swarm.bench.gloo) with
`train.target` set, so the trainer stops at the first evaluation that reaches it, or at the step
limit. Evaluations are uncompressed and the same for every codec; their time is left out of the
training seconds (each eval row carries its own `eval_s`), so a codec is not charged for how often
the config evaluates. Samples/s and the bounds come from swarm.bench.throughput_figures, over the
steps after the first.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from swarm.bench.points import Achieved, Point, flat_json, from_flat_json
from swarm.bench.throughput import codec_overrides, describe_setup, input_bytes_per_sample, run_point
from swarm.bench.throughput_figures import measure_run
from swarm.config import load_config
from swarm.config.target import Target
from swarm.lab.plan import available_cores
from swarm.rates import parse_delay, parse_rate
from swarm.training.results import read_results


@dataclass
class Reaching:
    """How a run went towards the target: whether and when an evaluation reached it, what it
    trained in all, and the metric along the way."""

    target: str
    reached: bool
    steps_to_target: int | None  # the step of the first evaluation that reached the target
    seconds_to_target: float | None  # training seconds until then (evaluations left out)
    steps: int  # steps the run took
    train_seconds: float  # its training seconds in all
    final: float | None  # the metric at the last evaluation
    curve: list[list[float]] = field(default_factory=list)  # [training seconds, step, metric] per evaluation


@dataclass
class TargetRow:
    """One point of bench time-to-target; its JSON is flat (`to_json`, `from_json`)."""

    point: Point
    achieved: Achieved  # over the steps after the first
    reaching: Reaching

    def to_json(self) -> dict:
        return flat_json(self)

    @classmethod
    def from_json(cls, flat: dict) -> TargetRow:
        return from_flat_json(cls, flat)


def training_seconds(rows: list[dict]) -> list[dict]:
    """The rows with each step's and evaluation's `time_s` made training seconds: the evaluations
    before it (their `eval_s`) taken out."""
    spent, out = 0.0, []
    for row in rows:
        if row.get("type") in ("step", "eval") and "time_s" in row:
            own = row.get("eval_s", 0.0) if row["type"] == "eval" else 0.0
            row = {**row, "time_s": row["time_s"] - spent - own}
            spent += own
        out.append(row)
    return out


def reaching(rows: list[dict], target: Target) -> tuple[list[list[float]], dict | None]:
    """([training seconds, step, metric] of every evaluation, the first evaluation that reached the target)."""
    return _reaching(training_seconds(rows), target)


def _reaching(trained: list[dict], target: Target) -> tuple[list[list[float]], dict | None]:
    curve, first = [], None
    for row in trained:
        if row.get("type") != "eval":
            continue
        metrics = row.get("uncompressed", {})
        target.require_reported(metrics)
        curve.append([row["time_s"], row["step"], metrics[target.metric]])
        if first is None and target.reached(metrics):
            first = row
    return curve, first


def target_row(
    rows: list[dict],
    codec: str,
    bandwidth: str,
    delay: str | None,
    target: Target,
    stages: int,
    input_bytes: float,
    shaping: str,
) -> TargetRow:
    forward, backward, _ = codec_overrides(codec)
    # the links' own counts (the meter) would take in the evaluations' traffic: the payload of the
    # training steps alone bounds the links here
    trained = [row for row in training_seconds(rows) if row["type"] != "meter"]
    curve, first = _reaching(trained, target)
    steps = [r for r in trained if r["type"] == "step"]
    figures = measure_run(
        trained,
        stages,
        parse_rate(bandwidth),
        input_bytes,
        download_limited=shaping == "netns",
        cores=available_cores(),
        delay_s=parse_delay(delay) if delay else 0.0,
    )
    went = Reaching(
        str(target),
        first is not None,
        first["step"] if first else None,
        first["time_s"] if first else None,
        len(steps),
        steps[-1]["time_s"] if steps else 0.0,
        curve[-1][2] if curve else None,
        curve,
    )
    delay_ms = 1000 * parse_delay(delay) if delay else 0.0
    return TargetRow(
        Point(forward, backward, parse_rate(bandwidth) / 1e6, shaping, delay_ms),
        from_flat_json(Achieved, figures),
        went,
    )


def run_time_to_target(
    config: str,
    bandwidths: list[str],
    codecs: list[str],
    target: str,
    delay: str | None = None,
    stages: int = 4,
    max_steps: int | None = None,
    shaping: str | None = None,
    overrides: list[str] | None = None,
    log=print,
) -> list[TargetRow]:
    goal = Target.parse(target)
    overrides = [*(overrides or []), f"train.target={target}"]
    setup = [*overrides, f"model.num_stages={stages}"]
    load_config(config, setup)  # a bad config or target: one line before any swarm starts
    input_bytes = input_bytes_per_sample(config, setup)
    log(describe_setup(config, setup, available_cores()))
    rows: list[TargetRow] = []
    with tempfile.TemporaryDirectory(prefix="hivepipe-time-to-target-") as tmp:
        for bandwidth in sorted(bandwidths, key=parse_rate):
            for codec in codecs:
                forward, backward, codec_sets = codec_overrides(codec)
                results = Path(tmp) / f"{len(rows)}.jsonl"
                limit = f"at most {max_steps} steps" if max_steps else "the config's steps at most"
                log(f"== {forward} / {backward} at {bandwidth}, delay {delay or 'none'}: until {goal}, {limit}")
                sets = [*overrides, *codec_sets]
                lab = run_point(
                    codec,
                    config,
                    stages,
                    results,
                    max_steps,
                    sets,
                    log,
                    bandwidth=bandwidth,
                    delay=delay,
                    shaping=shaping,
                )
                row = target_row(
                    read_results(results), codec, bandwidth, delay, goal, stages, input_bytes, lab.link_plan.shaping
                )
                log("   " + describe_row(row))
                rows.append(row)
    return rows


def describe_row(row: TargetRow) -> str:
    went, speed = row.reaching, row.achieved
    if went.reached:
        got = f"{went.target} at step {went.steps_to_target} after {went.seconds_to_target:.1f}s of training"
    else:
        final = f"{went.final:.4f}" if went.final is not None else "no evaluation"
        got = f"{went.target} not reached in {went.steps} steps ({went.train_seconds:.1f}s; last: {final})"
    bound = min(speed.link_bound, speed.compute_bound)
    fraction = f"{100 * speed.fraction_of_bound:.0f}% of" if math.isfinite(bound) else "no"
    return f"{got}; {speed.samples_per_s:.1f} samples/s, {fraction} the bound ({speed.binding})"
