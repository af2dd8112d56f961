"""`python -m swarm bench time-to-target`: time to a target at the length real runs train, as
ProtocolNanoGPT measures it: T = steps to the target x seconds per step.

Steps come from one process per variant (swarm.bench.target_steps: the oracle makes them the
swarm's), seconds per step from a short lab run per variant and link (swarm.bench.step_time, which
also checks the lab's losses against one process's). One point can be run to the target in the lab
for real, its measured training seconds beside its T (`run_real`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.bench.lab_seconds import reaching
from swarm.bench.step_time import LabSetup, Link, lab_rows, step_time
from swarm.bench.target_steps import StepRuns, Steps, Variant
from swarm.bench.throughput import codec_overrides
from swarm.config.target import Target
from swarm.rates import parse_rate


@dataclass
class TimeRow:
    """One (variant, link) of the benchmark; its JSON is `asdict`'s."""

    optimizer: str
    schedule: str
    codec: str
    backward: str
    bandwidth_mbit: float
    delay_ms: float
    target: str
    reached: bool
    steps_to_target: int | None
    steps: int  # the one-process run's length
    final_metric: float | None
    step_seconds: float
    T: float | None  # steps_to_target x step_seconds
    samples_per_s: float
    fraction_of_bound: float
    binding: str
    oracle_gap: float
    kind: str = "estimate"  # or "real": run to the target in the lab
    measured_seconds: float | None = None  # real: its training seconds to the target

    @property
    def variant(self) -> Variant:
        return Variant(self.optimizer, self.schedule, self.codec)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    """What a benchmark runs: the variants, on every link."""

    variants: list[Variant]
    links: list[Link]
    target: Target
    work: Path
    jobs: int = 1

    def check(self) -> None:
        for variant in self.variants:
            variant.check()


def estimate_row(variant: Variant, link: Link, steps: Steps, timed, target: Target) -> TimeRow:
    forward, backward, _ = codec_overrides(variant.codec)
    return TimeRow(
        variant.optimizer,
        variant.schedule,
        variant.codec,
        backward,
        parse_rate(link.bandwidth) / 1e6,
        link.delay_ms,
        str(target),
        steps.reached,
        steps.steps_to_target,
        steps.steps,
        steps.final,
        timed.step_seconds,
        steps.steps_to_target * timed.step_seconds if steps.reached else None,
        timed.achieved.samples_per_s,
        timed.achieved.fraction_of_bound,
        timed.achieved.binding,
        timed.oracle_gap,
    )


def run_estimates(plan: Plan, setup: LabSetup, log=print) -> tuple[list[TimeRow], dict[Variant, Steps]]:
    plan.check()
    runs = StepRuns(setup.config, list(setup.overrides), plan.work, log)
    steps = runs.steps(plan.variants, plan.target, plan.jobs)
    for variant in plan.variants:
        went = steps[variant]
        log(
            f"   {variant.label}: "
            + (
                f"{plan.target} at step {went.steps_to_target}"
                if went.reached
                else f"{plan.target} not reached in {went.steps} steps (last {went.final})"
            )
        )
    rows = []
    for link in plan.links:
        for variant in plan.variants:
            timed = step_time(setup, variant, link, steps[variant].losses, log)
            rows.append(estimate_row(variant, link, steps[variant], timed, plan.target))
    return rows, steps


def run_real(row: TimeRow, setup: LabSetup, link: Link, log=print) -> TimeRow:
    """`row`'s point trained in the lab until the target (or the one-process run's length): its
    measured training seconds (evaluations left out) beside the estimate."""
    variant = row.variant
    sets = [*setup.overrides, *variant.overrides(), f"train.target={row.target}"]
    log(f"== {variant.label} at {link.bandwidth}, delay {link.delay or 'none'}: to {row.target} in the lab")
    rows, _ = lab_rows(setup, variant, link, sets, row.steps, log)
    _, first = reaching(rows, Target.parse(row.target))
    measured = first["time_s"] if first else None
    log(
        f"   measured {measured if measured is None else round(measured, 1)} s against T = {row.T if row.T is None else round(row.T, 1)} s"
    )
    return TimeRow(**{**asdict(row), "kind": "real", "measured_seconds": measured, "reached": first is not None})
