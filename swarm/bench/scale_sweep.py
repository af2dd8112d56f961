"""`python -m swarm bench scale`: the scale model (swarm.bench.scale_model) over stages x replicas,
its rows in docs/bench/scale.json beside the lab's, a table and a plot.

A row is flat JSON: `kind` ("model" here; "lab" rows are measured and kept as they are), `stages`,
`replicas`, `peers`, `bandwidth_mbit` and `delay_ms` (the drawn links' medians; the spreads are in
`bandwidth_spread_mbit` and `delay_spread_ms`), `samples_per_s` and `model_samples_per_s` (both
the model's here), `rss_mib_per_peer` (lab rows only), then the model's parts.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from swarm.bench.scale_model import ScalePoint, draw, predict


def model_row(point: ScalePoint) -> dict:
    """One point's row (module doc)."""
    p, links = predict(point), [r.link for replicas in draw(point) for r in replicas]
    return {
        "kind": "model",
        "stages": point.stages,
        "replicas": point.replicas,
        "peers": point.stages * point.replicas,
        "bandwidth_mbit": round(statistics.median(link.up_bits for link in links) / 1e6, 1),
        "delay_ms": round(statistics.median(link.delay_s for link in links) * 1000, 1),
        "samples_per_s": round(p.samples_per_s, 3),
        "model_samples_per_s": round(p.samples_per_s, 3),
        "rss_mib_per_peer": None,
        "bandwidth_spread_mbit": list(point.spread.rate_mbit),
        "delay_spread_ms": list(point.spread.delay_ms),
        "leave_per_hour": point.churn.leave_per_hour,
        "seed": point.spread.seed,
        "step_s": round(p.step_s, 2),
        "pipeline_s": round(p.pipeline_s, 2),
        "averaging_s": round(p.averaging_s, 2),
        "churn_s": round(p.churn_s, 2),
        "replicas_present": round(p.present, 2),
        "routed_min": p.routed[0],
        "routed_max": p.routed[1],
        "bounds": {k: round(v, 2) for k, v in p.bounds.items()},
        "pipeline_fraction": round(p.pipeline_fraction, 3),
        "dht_records_per_s": round(p.dht.records_per_s, 1),
        "dht_stores_per_s": round(p.dht.stores_per_s, 1),
        "dht_lookups_per_s": round(p.dht.lookups_per_s, 1),
        "dht_hottest_stores_per_s": round(p.dht.hottest_stores_per_s, 1),
        "saturates": p.saturates,
        "limits": p.limits,
    }


def sweep(base: ScalePoint, stages: Sequence[int], replicas: Sequence[int], log: Callable[[str], None]) -> list[dict]:
    rows = []
    for s in stages:
        for r in replicas:
            rows.append(row := model_row(replace(base, stages=s, replicas=r)))
            log(row_line(row))
    return rows


def row_line(row: dict) -> str:
    return (
        f"{row['stages']:>3} x {row['replicas']:>2} = {row['peers']:>4} peers: {row['samples_per_s']:8.2f} samples/s, "
        f"step {row['step_s']:7.1f} s (averaging {row['averaging_s']:5.1f}), DHT {row['dht_records_per_s']:6.1f} records/s; "
        f"saturates: {row['saturates']}"
    )


def merge(path: Path, rows: list[dict]) -> list[dict]:
    """The file's rows of other kinds (the lab's) kept, its model rows replaced by `rows`."""
    kept = []
    if path.exists():
        kept = [r for r in json.loads(path.read_text()) if r.get("kind") != "model"]
    return sorted(kept, key=lambda r: (r.get("kind", ""), r["stages"], r["replicas"])) + rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(merge(path, rows), indent=1) + "\n")


def table(rows: list[dict]) -> str:
    """Markdown: one line per point."""
    lines = [
        "| stages | replicas | peers | samples/s | step s | averaging s | churn s | micro-batches per replica | DHT records/s | listing stores/s | saturates |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stages']} | {r['replicas']} | {r['peers']} | {r['samples_per_s']:.2f} | {r['step_s']:.0f} | "
            f"{r['averaging_s']:.1f} | {r['churn_s']:.1f} | {r['routed_min']}-{r['routed_max']} | "
            f"{r['dht_records_per_s']:.0f} | {r['dht_hottest_stores_per_s']:.0f} | {r['saturates']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """samples/s against replicas, one line per stage count; averaging seconds against group size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = sorted({r["leave_per_hour"] for r in rows})
    for i, stages in enumerate(sorted({r["stages"] for r in rows})):
        for rate, style in zip(rates, ("-", "--", ":"), strict=False):
            mine = [r for r in rows if r["stages"] == stages and r["leave_per_hour"] == rate]
            mine.sort(key=lambda r: r["replicas"])
            xs, label = [r["replicas"] for r in mine], f"{stages} stages, {rate:g} leave/peer/h"
            left.plot(xs, [r["samples_per_s"] for r in mine], style, marker="o", color=f"C{i}", label=label)
            if rate == rates[0]:
                right.plot(xs, [r["averaging_s"] for r in mine], marker="o", color=f"C{i}", label=f"{stages} stages")
    left.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas per stage")
        ax.grid(alpha=0.3)
    left.set_ylabel("samples/s (model)")
    right.set_ylabel("averaging s per step (slowest stage)")
    left.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
