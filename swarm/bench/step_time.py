"""bench time-to-target's seconds per step: a short lab run per variant and link (shaped links,
real peers), its steady step time after the first steps, and its losses against one process's.

A step's time in a steady pipeline does not depend on how far training is (the same shapes, bytes
and compute at every step), so a dozen steps measure it; the schedule they run is the whole run's
(`optimizer.schedule_steps`), so their losses are the first losses of the one-process run, which the
oracle says they must equal: `oracle_gap` is the largest relative difference (0 when it holds).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from swarm.bench.lab_seconds import training_seconds
from swarm.bench.points import Achieved, from_flat_json
from swarm.bench.target_steps import Variant
from swarm.bench.throughput import input_bytes_per_sample, run_point
from swarm.bench.throughput_figures import RunLinks, measure_run
from swarm.config import load_config
from swarm.lab.plan import available_cores
from swarm.rates import parse_delay, parse_rate
from swarm.training.results import read_results

WARMUP = 2  # steps left out: the pipeline fills, the first step's peers warm their caches


@dataclass(frozen=True)
class Link:
    """Every process's access link: rate and one-way delay (None: none), how it is shaped."""

    bandwidth: str
    delay: str | None
    shaping: str | None = None

    @property
    def delay_ms(self) -> float:
        return 1000 * parse_delay(self.delay) if self.delay else 0.0


@dataclass
class StepTime:
    step_seconds: float  # steady seconds per step
    achieved: Achieved  # samples/s against the bounds, over the steps after WARMUP
    oracle_gap: float  # the largest relative loss difference to one process's (0: equal)
    shaping: str


@dataclass(frozen=True)
class LabSetup:
    """What every lab run of a benchmark shares: the config, its overrides, stages and length."""

    config: str
    overrides: tuple[str, ...]
    stages: int
    steps: int


def oracle_gap(ours: list[float], theirs: list[float]) -> float:
    """The largest relative difference of `ours` to the first of `theirs` (inf: more losses than theirs)."""
    if len(ours) > len(theirs):
        return float("inf")
    return max((abs(a - b) / abs(b) if b else abs(a) for a, b in zip(ours, theirs, strict=False)), default=0.0)


def lab_rows(setup: LabSetup, variant: Variant, link: Link, sets: list[str], steps: int, log=print):
    """`steps` steps of `variant` with `sets` in the lab on `link`: (its results rows, the lab)."""
    with tempfile.TemporaryDirectory(prefix="hivepipe-time-to-target-") as tmp:
        results = Path(tmp) / "lab.jsonl"
        shaping = {"bandwidth": link.bandwidth, "delay": link.delay, "shaping": link.shaping}
        lab = run_point(variant.codec, setup.config, setup.stages, results, steps, sets, log, **shaping)
        return read_results(results), lab


def step_time(setup: LabSetup, variant: Variant, link: Link, one_process: list[float], log=print) -> StepTime:
    sets = [*setup.overrides, *variant.overrides(), f"model.num_stages={setup.stages}"]
    load_config(setup.config, sets)  # one line for a bad variant before a lab starts
    log(f"== {variant.label} at {link.bandwidth}, delay {link.delay or 'none'}: {setup.steps} steps in the lab")
    rows, lab = lab_rows(setup, variant, link, sets, setup.steps, log)
    trained = [r for r in training_seconds(rows) if r["type"] != "meter"]
    links = RunLinks(
        parse_rate(link.bandwidth), link.delay_ms / 1000, download_limited=lab.link_plan.shaping == "netns"
    )
    input_bytes = input_bytes_per_sample(setup.config, sets)
    figures = measure_run(trained, setup.stages, links, input_bytes, warmup=WARMUP, cores=available_cores())
    achieved = from_flat_json(Achieved, figures)
    batch = load_config(setup.config, sets).train.batch_size
    losses = [r["loss"] for r in trained if r["type"] == "step"]
    timed = StepTime(batch / achieved.samples_per_s, achieved, oracle_gap(losses, one_process), lab.link_plan.shaping)
    log(
        f"   {timed.step_seconds:.3f} s per step ({achieved.samples_per_s:.1f} samples/s, "
        f"{100 * achieved.fraction_of_bound:.0f}% of the bound: {achieved.binding}); losses against one process: "
        + ("equal" if timed.oracle_gap == 0 else f"differ by {timed.oracle_gap:.2e}")
    )
    return timed
