"""The throughput benchmark's rows for people and files: the table, speed-ups over no compression,
how the points stand against the target, where the CPU went, a plot and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

from swarm.bench.gloo.launch import GLOO
from swarm.bench.throughput_figures import ThroughputRow

TARGET_FRACTION = 0.9  # the target: achieved >= 90% of min(link bound, compute bound) where a link binds


def cpu_breakdown(row: ThroughputRow) -> str:
    """Where the machine's CPU went per sample: the stages' computing threads, the rest of the stage
    peers (event loops, framing, pacing), their p2p daemons, the trainer and bootstrap, the rest."""
    use = row.cpu
    cpu = use.cpu_ms_per_sample or {}
    stages = [pair for name, pair in cpu.items() if name.startswith("stage")]
    others = [pair for name, pair in cpu.items() if not name.startswith("stage")]
    compute = use.compute_cpu_ms_per_sample or 0.0
    parts = {
        "stage compute": compute,
        "stage peers' other threads": sum(own for own, _ in stages) - compute,
        "stage p2p daemons": sum(daemon for _, daemon in stages),
        "trainer and bootstrap (and daemons)": sum(own + daemon for own, daemon in others),
    }
    rest = (use.machine_cpu_ms_per_sample or 0.0) - sum(parts.values())
    return (
        f"CPU per sample: {use.machine_cpu_ms_per_sample or 0.0:.2f} ms = "
        + " + ".join(f"{name} {ms:.2f}" for name, ms in parts.items())
        + f" + the rest of the machine {rest:.2f}; compute is {100 * (use.compute_share or 0):.0f}% of it"
    )


def format_rows(rows: list[ThroughputRow]) -> str:
    header = [
        "codec (fw / bw)",
        "Mbit/s",
        "delay ms",
        "samples/s",
        "link bound",
        "compute bound",
        "of bound",
        "schedule bound",
        "of schedule",
        "busiest B/sample",
        "binding",
    ]
    table = [header] + [
        [
            f"{r.point.codec} / {r.point.backward}",
            f"{r.point.bandwidth_mbit:g}",
            f"{r.point.delay_ms:g}",
            f"{r.achieved.samples_per_s:.1f}",
            f"{r.achieved.link_bound:.1f}",
            f"{r.achieved.compute_bound:.1f}",
            f"{100 * r.achieved.fraction_of_bound:.0f}%",
            f"{r.bounds.schedule_bound:.1f}",
            f"{100 * r.bounds.schedule_fraction:.0f}%" if r.bounds.schedule_fraction else "-",
            f"{r.traffic.busiest_bytes_per_sample:,.0f}",
            r.achieved.binding,
        ]
        for r in rows
    ]
    return aligned(table)


def aligned(table: list[list[str]]) -> str:
    """Rows of cells as text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
        for line in table
    )


def speedups(rows: list[ThroughputRow], baseline: str = "none") -> dict[tuple[str, float], float]:
    """samples/s of each codec over the baseline's at the same bandwidth."""
    base = {r.point.bandwidth_mbit: r.achieved.samples_per_s for r in rows if r.point.codec == baseline}
    return {
        (r.point.codec, r.point.bandwidth_mbit): r.achieved.samples_per_s / base[r.point.bandwidth_mbit]
        for r in rows
        if r.point.bandwidth_mbit in base and r.point.codec != baseline
    }


def target_lines(rows: list[ThroughputRow], target: float = TARGET_FRACTION) -> list[str]:
    """How the rows stand against `target`, the link-bound points (the comm-bound configurations)
    apart from those the compute or the shared cores bound (where the p2p daemons, event loops and
    trainer take CPU from the stages: compute_share says how much)."""

    def name(r: ThroughputRow) -> str:
        return f"{r.point.codec} at {r.point.bandwidth_mbit:g} Mbit/s {100 * r.achieved.fraction_of_bound:.0f}%"

    measured = [r for r in rows if math.isfinite(r.achieved.fraction_of_bound)]
    linked = [r for r in measured if r.achieved.binding.startswith("link") and r.point.codec != GLOO]
    lines = []
    if linked:
        low = min(linked, key=lambda r: r.achieved.fraction_of_bound)
        met = sum(r.achieved.fraction_of_bound >= target for r in linked)
        lines.append(
            f"link-bound points at >= {100 * target:.0f}% of the bound: {met} of {len(linked)} (lowest: {name(low)})"
        )
    for r in measured:
        if not r.achieved.binding.startswith("link"):
            share = r.cpu.compute_share
            used = f"; the stages' compute used {100 * share:.0f}% of the busy CPU" if share else ""
            lines.append(f"bound by {r.achieved.binding}: {name(r)}{used}")
    return lines + against_gloo(rows)


def against_gloo(rows: list[ThroughputRow]) -> list[str]:
    """hivepipe uncompressed against torch.distributed (gloo) on the same links: the target is at least as fast."""
    gloo = {r.point.bandwidth_mbit: r.achieved for r in rows if r.point.codec == GLOO}
    lines = []
    for r in rows:
        if r.point.codec == "none" and r.point.bandwidth_mbit in gloo:
            ours, other = r.achieved, gloo[r.point.bandwidth_mbit]
            factor = ours.samples_per_s / other.samples_per_s
            verdict = "met" if factor >= 1 else f"missed by {100 * (1 - factor):.0f}%"
            lines.append(
                f"none against torch:gloo at {r.point.bandwidth_mbit:g} Mbit/s: {ours.samples_per_s:.1f} against {other.samples_per_s:.1f} samples/s, {factor:.2f}x (target >= 1x: {verdict}); gloo at {100 * other.fraction_of_bound:.0f}% of its bound"
            )
    return lines


def plot(rows: list[ThroughputRow], path: str, title: str) -> None:
    """samples/s against bandwidth per codec, with each codec's link bound (dashed) and compute bound (dotted)."""
    # matplotlib only when a plot is asked for: it is an optional dependency and slow to import
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, codec in enumerate(dict.fromkeys(r.point.codec for r in rows)):
        mine = sorted((r for r in rows if r.point.codec == codec), key=lambda r: r.point.bandwidth_mbit)
        color = f"C{i}"
        x = [r.point.bandwidth_mbit for r in mine]
        got = [r.achieved for r in mine]
        ax.plot(x, [a.samples_per_s for a in got], "o-", color=color, label=f"{codec} / {mine[0].point.backward}")
        ax.plot(x, [a.link_bound for a in got], "--", color=color, alpha=0.6)
        compute = [(b, a.compute_bound) for b, a in zip(x, got, strict=True) if math.isfinite(a.compute_bound)]
        if compute:  # measured at each point: the stages share this machine's cores with the traffic
            ax.plot(*zip(*compute, strict=True), ":", color=color, alpha=0.6)
    ax.plot([], [], "k--", alpha=0.6, label="link bound")
    ax.plot([], [], "k:", alpha=0.6, label="compute bound (measured per point)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth per process link (Mbit/s)")
    ax.set_ylabel("training samples / s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(rows: list[ThroughputRow]) -> str:
    """The rows as docs/bench/throughput*.json hold them: a flat object per point."""
    return json.dumps([r.to_json() for r in rows], indent=1)


def from_json(text: str) -> list[ThroughputRow]:
    """`to_json`'s rows back, a committed file's too."""
    return [ThroughputRow.from_json(flat) for flat in json.loads(text)]
