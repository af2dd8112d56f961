"""bench time-to-target's rows (swarm.bench.target_estimate) as a table, how they stand against
the targets, a plot and JSON."""

from __future__ import annotations

import json

from swarm.bench.gloo.launch import GLOO
from swarm.bench.target_estimate import TimeRow
from swarm.bench.target_steps import Steps, Variant
from swarm.bench.throughput_table import aligned
from swarm.config.target import Target

SOONER = 4.0  # the best codec and schedule reach the target this many times sooner (by T)
ASYNC_STEPS = 1.1  # asynchronous steps to the target at most this many times the synchronous
REAL_WITHIN = 0.10  # a real run's measured seconds within this fraction of its T


def format_rows(rows: list[TimeRow]) -> str:
    header = [
        "optimizer",
        "schedule",
        "codec",
        "Mbit/s",
        "delay ms",
        "steps",
        "s/step",
        "T s",
        "samples/s",
        "bound",
        "oracle",
    ]
    table = [header]
    for r in rows:
        steps = str(r.steps_to_target) if r.reached else f">{r.steps}"
        total = f"{r.T:.0f}" if r.T is not None else "-"
        if r.kind == "real":
            total += (
                f" (measured {r.measured_seconds:.0f})"
                if r.measured_seconds is not None
                else " (measured: not reached)"
            )
        table.append(
            [
                r.optimizer,
                r.schedule,
                r.codec if r.codec == r.backward or r.codec == GLOO else f"{r.codec}|{r.backward}",
                f"{r.bandwidth_mbit:g}",
                f"{r.delay_ms:g}",
                steps,
                f"{r.step_seconds:.3f}",
                total,
                f"{r.samples_per_s:.1f}",
                f"{100 * r.fraction_of_bound:.0f}% {r.binding}",
                "equal" if r.oracle_gap == 0 else f"{r.oracle_gap:.1e}",
            ]
        )
    return aligned(table)


def _links(row: TimeRow) -> tuple[float, float]:
    return row.bandwidth_mbit, row.delay_ms


def _verdict(factor: float, goal: float, at_most: bool = False) -> str:
    ok = factor <= goal if at_most else factor >= goal
    return "met" if ok else f"missed ({factor:.2f}x against {goal:g}x)"


def target_lines(rows: list[TimeRow]) -> list[str]:
    """Per link and optimizer: asynchronous against synchronous steps (uncompressed), the best T
    against uncompressed synchronous training and against torch:gloo, and real runs against T."""
    lines = []
    estimates = [r for r in rows if r.kind == "estimate"]
    for key in dict.fromkeys(_links(r) for r in estimates):
        for optimizer in dict.fromkeys(r.optimizer for r in estimates):
            here = [r for r in estimates if _links(r) == key and r.optimizer == optimizer]
            where = f"{optimizer} at {key[0]:g} Mbit/s, {key[1]:g} ms"
            sync = next((r for r in here if r.schedule == "sync" and r.codec == "none"), None)
            gloo = next((r for r in here if r.codec == GLOO), None)
            for other in (r for r in here if r.schedule != "sync" and r.codec == "none"):
                if sync is not None and sync.reached and other.reached:
                    factor = other.steps_to_target / sync.steps_to_target
                    lines.append(
                        f"{where}: {other.schedule} needs {other.steps_to_target} steps to {other.target}, synchronous {sync.steps_to_target}: {factor:.2f}x (target <= {ASYNC_STEPS:g}x: {_verdict(factor, ASYNC_STEPS, True)})"
                    )
            ours = [r for r in here if r.codec != GLOO and r.T is not None]
            if not ours:
                lines.append(f"{where}: no variant reached the target")
                continue
            best = min(ours, key=lambda r: r.T)
            for name, base in (("uncompressed synchronous", sync), (GLOO, gloo)):
                if base is None:
                    continue
                if base is best:
                    lines.append(
                        f"{where}: {name} is the soonest to {best.target} ({best.T:.0f} s; target >= {SOONER:g}x: missed)"
                    )
                    continue
                if base.T is None:
                    lines.append(
                        f"{where}: {name} did not reach {best.target}; {best.schedule} {best.codec} in {best.T:.0f} s"
                    )
                    continue
                factor = base.T / best.T
                lines.append(
                    f"{where}: {best.schedule} {best.codec} reaches {best.target} in {best.T:.0f} s, {factor:.2f}x sooner than {name} ({base.T:.0f} s; target >= {SOONER:g}x: {_verdict(factor, SOONER)})"
                )
    for r in (r for r in rows if r.kind == "real"):
        where = f"{r.optimizer} {r.schedule} {r.codec} at {r.bandwidth_mbit:g} Mbit/s, {r.delay_ms:g} ms"
        if r.measured_seconds is None or r.T is None:
            lines.append(f"{where}: run to the target in the lab, it did not reach it")
            continue
        off = abs(r.measured_seconds - r.T) / r.measured_seconds
        verdict = "met" if off <= REAL_WITHIN else f"missed ({100 * off:.0f}%)"
        lines.append(
            f"{where}: measured {r.measured_seconds:.0f} s to the target in the lab, T = {r.T:.0f} s: {100 * off:.0f}% apart (target <= {100 * REAL_WITHIN:.0f}%: {verdict})"
        )
    return lines


def plot(rows: list[TimeRow], steps: dict[Variant, Steps], path: str, title: str) -> None:
    """The evaluation metric against estimated training seconds (its step x the row's seconds per
    step), a curve per variant, a panel per link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    estimates = [r for r in rows if r.kind == "estimate"]
    keys = list(dict.fromkeys(_links(r) for r in estimates))
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.5), squeeze=False)
    goal = Target.parse(estimates[0].target)
    for ax, key in zip(axes[0], keys, strict=True):
        for i, r in enumerate(r for r in estimates if _links(r) == key):
            curve = steps[r.variant].curve
            ax.plot(
                [s * r.step_seconds for s, _ in curve],
                [m for _, m in curve],
                "x--" if r.codec == GLOO else "-",
                color=f"C{i % 10}",
                label=r.variant.label,
            )
        ax.axhline(goal.value, color="k", linestyle=":", alpha=0.6, label=f"target {goal}")
        ax.set_xlabel("training seconds (steps x seconds per step)")
        ax.set_ylabel(f"evaluation {goal.metric}")
        ax.set_xscale("log")
        ax.set_title(f"{key[0]:g} Mbit/s, {key[1]:g} ms one way")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(rows: list[TimeRow]) -> str:
    return json.dumps([r.to_json() for r in rows], indent=1)


def from_json(text: str) -> list[TimeRow]:
    return [TimeRow(**row) for row in json.loads(text)]
