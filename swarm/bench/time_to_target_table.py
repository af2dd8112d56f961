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
    base = {_links(r): r for r in rows if r.point.codec == "none"}
    table = [header]
    for r in rows:
        none = base.get(_links(r))
        sooner = sooner_than(r, none) if none is not None and r is not none else None
        went, speed = r.reaching, r.achieved
        table.append(
            [
                r.point.codec,
                r.point.backward,
                f"{r.point.bandwidth_mbit:g}",
                f"{r.point.delay_ms:g}",
                "yes" if went.reached else "no",
                str(went.steps_to_target if went.reached else went.steps),
                f"{went.seconds_to_target:.1f}" if went.reached else f">{went.train_seconds:.1f}",
                f"{speed.samples_per_s:.1f}",
                f"{speed.link_bound:.1f}",
                f"{speed.compute_bound:.1f}" if math.isfinite(speed.compute_bound) else "-",
                f"{sooner:.2f}" if sooner is not None else "-",
            ]
        )
    return aligned(table)


def sooner_than(row: TargetRow, none: TargetRow) -> float | None:
    """How many times sooner `row` reached the target than `none` (None when `row` did not reach it;
    a lower bound when only `none` missed it: its training time is then what it had)."""
    went, other = row.reaching, none.reaching
    if not went.reached:
        return None
    theirs = other.seconds_to_target if other.reached else other.train_seconds
    return theirs / went.seconds_to_target if went.seconds_to_target else None


def _links(row: TargetRow) -> tuple[float, float]:
    """The links a row ran on (rows on the same links are compared): bandwidth and delay."""
    return row.point.bandwidth_mbit, row.point.delay_ms


def target_lines(rows: list[TargetRow], sooner: float = SOONER) -> list[str]:
    """Per bandwidth and delay: the best codec against none (target: `sooner` times sooner) and
    hivepipe's none against torch:gloo (target: at least as fast, in samples/s and to the target)."""
    lines = []
    for key in dict.fromkeys(_links(r) for r in rows):
        here = [r for r in rows if _links(r) == key]
        where = f"at {key[0]:g} Mbit/s, {key[1]:g} ms"
        none = next((r for r in here if r.point.codec == "none"), None)
        gloo = next((r for r in here if r.point.codec == GLOO), None)
        compressed = [r for r in here if r.point.codec not in ("none", GLOO) and r.reaching.reached]
        if none is not None and compressed:
            best = min(compressed, key=lambda r: r.reaching.seconds_to_target)
            factor = sooner_than(best, none)
            bound = "" if none.reaching.reached else " (at least: none did not reach it)"
            verdict = "met" if factor >= sooner else f"missed by {100 * (1 - factor / sooner):.0f}%"
            lines.append(
                f"{where}: {best.point.codec} reached {best.reaching.target} {factor:.2f}x sooner than none{bound} (target >= {sooner:g}x: {verdict})"
            )
        elif none is not None and not compressed:
            lines.append(f"{where}: no compressed codec reached {none.reaching.target}")
        if none is not None and gloo is not None:
            factor = none.achieved.samples_per_s / gloo.achieved.samples_per_s
            verdict = "met" if factor >= 1 else f"missed by {100 * (1 - factor):.0f}%"
            race = ""
            ours, theirs = none.reaching, gloo.reaching
            if ours.reached and theirs.reached:
                race = f"; to the target {ours.seconds_to_target:.1f}s against gloo's {theirs.seconds_to_target:.1f}s"
            lines.append(
                f"{where}: none {none.achieved.samples_per_s:.1f} samples/s against torch:gloo {gloo.achieved.samples_per_s:.1f}, {factor:.2f}x (target >= 1x: {verdict}){race}"
            )
    return lines


def plot(rows: list[TargetRow], path: str, title: str) -> None:
    """The evaluation metric against training seconds, one curve per codec, a panel per bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(_links(r) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.5), squeeze=False)
    codecs = list(dict.fromkeys(r.point.codec for r in rows))
    target = rows[0].reaching.target
    for ax, key in zip(axes[0], keys, strict=True):
        for r in (r for r in rows if _links(r) == key):
            codec, curve = r.point.codec, r.reaching.curve
            seconds, _, values = zip(*curve, strict=True) if curve else ((), (), ())
            label = codec if codec in (GLOO, "none") else f"{codec} / {r.point.backward}"
            ax.plot(seconds, values, ".-" if codec != GLOO else "x--", color=f"C{codecs.index(codec)}", label=label)
        goal = Target.parse(target)
        metric, value = goal.metric, goal.value
        ax.axhline(value, color="k", linestyle=":", alpha=0.6, label=f"target {target}")
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
    """The rows as docs/bench/time-to-target.json holds them: a flat object per point."""
    return json.dumps([r.to_json() for r in rows], indent=1)


def from_json(text: str) -> list[TargetRow]:
    """`to_json`'s rows back, a committed file's too."""
    return [TargetRow.from_json(flat) for flat in json.loads(text)]
