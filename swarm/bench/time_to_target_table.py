"""bench time-to-target's rows as a table, how they stand against the targets, a plot and JSON."""

from __future__ import annotations

import json
import math

from swarm.bench.gloo.launch import GLOO
from swarm.bench.throughput_table import aligned
from swarm.bench.time_to_target import TargetRow
from swarm.config.target import Target

SOONER = 4.0  # the target: the best codec reaches the target this many times sooner than none


def format_rows(rows: list[TargetRow]) -> str:
    header = [
        "codec",
        "backward",
        "Mbit/s",
        "delay ms",
        "reached",
        "steps",
        "seconds",
        "samples/s",
        "link bound",
        "compute bound",
        "x none",
    ]
    base = {(r.bandwidth_mbit, r.delay_ms): r for r in rows if r.codec == "none"}
    table = [header]
    for r in rows:
        none = base.get((r.bandwidth_mbit, r.delay_ms))
        sooner = sooner_than(r, none) if none is not None and r is not none else None
        table.append(
            [
                r.codec,
                r.backward,
                f"{r.bandwidth_mbit:g}",
                f"{r.delay_ms:g}",
                "yes" if r.reached else "no",
                str(r.steps_to_target if r.reached else r.steps),
                f"{r.seconds_to_target:.1f}" if r.reached else f">{r.train_seconds:.1f}",
                f"{r.samples_per_s:.1f}",
                f"{r.link_bound:.1f}",
                f"{r.compute_bound:.1f}" if math.isfinite(r.compute_bound) else "-",
                f"{sooner:.2f}" if sooner is not None else "-",
            ]
        )
    return aligned(table)


def sooner_than(row: TargetRow, none: TargetRow) -> float | None:
    """How many times sooner `row` reached the target than `none` (None when `row` did not reach it;
    a lower bound when only `none` missed it: its training time is then what it had)."""
    if not row.reached:
        return None
    other = none.seconds_to_target if none.reached else none.train_seconds
    return other / row.seconds_to_target if row.seconds_to_target else None


def target_lines(rows: list[TargetRow], sooner: float = SOONER) -> list[str]:
    """Per bandwidth and delay: the best codec against none (target: `sooner` times sooner) and
    hivepipe's none against torch:gloo (target: at least as fast, in samples/s and to the target)."""
    lines = []
    for key in dict.fromkeys((r.bandwidth_mbit, r.delay_ms) for r in rows):
        here = [r for r in rows if (r.bandwidth_mbit, r.delay_ms) == key]
        where = f"at {key[0]:g} Mbit/s, {key[1]:g} ms"
        none = next((r for r in here if r.codec == "none"), None)
        gloo = next((r for r in here if r.codec == GLOO), None)
        compressed = [r for r in here if r.codec not in ("none", GLOO) and r.reached]
        if none is not None and compressed:
            best = min(compressed, key=lambda r: r.seconds_to_target)
            factor = sooner_than(best, none)
            bound = "" if none.reached else " (at least: none did not reach it)"
            verdict = "met" if factor >= sooner else f"missed by {100 * (1 - factor / sooner):.0f}%"
            lines.append(
                f"{where}: {best.codec} reached {best.target} {factor:.2f}x sooner than none{bound} (target >= {sooner:g}x: {verdict})"
            )
        elif none is not None and not compressed:
            lines.append(f"{where}: no compressed codec reached {none.target}")
        if none is not None and gloo is not None:
            factor = none.samples_per_s / gloo.samples_per_s
            verdict = "met" if factor >= 1 else f"missed by {100 * (1 - factor):.0f}%"
            race = ""
            if none.reached and gloo.reached:
                race = f"; to the target {none.seconds_to_target:.1f}s against gloo's {gloo.seconds_to_target:.1f}s"
            lines.append(
                f"{where}: none {none.samples_per_s:.1f} samples/s against torch:gloo {gloo.samples_per_s:.1f}, {factor:.2f}x (target >= 1x: {verdict}){race}"
            )
    return lines


def plot(rows: list[TargetRow], path: str, title: str) -> None:
    """The evaluation metric against training seconds, one curve per codec, a panel per bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.bandwidth_mbit, r.delay_ms) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.5), squeeze=False)
    codecs = list(dict.fromkeys(r.codec for r in rows))
    for ax, key in zip(axes[0], keys, strict=True):
        for r in (r for r in rows if (r.bandwidth_mbit, r.delay_ms) == key):
            color = f"C{codecs.index(r.codec)}"
            seconds, _, values = zip(*r.curve, strict=True) if r.curve else ((), (), ())
            label = r.codec if r.codec in (GLOO, "none") else f"{r.codec} / {r.backward}"
            ax.plot(seconds, values, ".-" if r.codec != GLOO else "x--", color=color, label=label)
        goal = Target.parse(rows[0].target)
        metric, value = goal.metric, goal.value
        ax.axhline(value, color="k", linestyle=":", alpha=0.6, label=f"target {rows[0].target}")
        ax.set_xlabel("training seconds (evaluations left out)")
        ax.set_ylabel(f"evaluation {metric}")
        ax.set_title(f"{key[0]:g} Mbit/s, {key[1]:g} ms one way")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(rows: list[TargetRow]) -> str:
    return json.dumps([r.as_dict() for r in rows], indent=1)
