"""PNG curves for a report table: training loss per step, and the test metric per epoch with
compression off (solid) and on (dashed); each row's mean over its seeds, with a band from the
lowest to the highest seed."""

from __future__ import annotations

import statistics
from pathlib import Path


def slug(title: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in title.lower()).split())


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing running mean (per-step batch losses are noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def across_seeds(curves: list[dict[float, float]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min, max over the seeds' curves ({x: y}), at the x every seed has."""
    xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    ys = [[c[x] for c in curves] for x in xs]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def _draw(ax, curves: list[dict[float, float]], **style):
    xs, mean, low, high = across_seeds(curves)
    line = ax.plot(xs, mean, **style)
    if len(curves) > 1:
        ax.fill_between(xs, low, high, color=line[0].get_color(), alpha=0.2, linewidth=0)
    return line[0].get_color()


def plot_table(title: str, groups: list[list[dict]], out: Path) -> Path:
    """One figure for a table; `groups`: each row's runs (one per seed)."""
    # matplotlib, a large import, loads only when a figure is drawn (a report whose runs have no
    # steps yet draws none), and the Agg backend is chosen before pyplot loads: no display needed.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(13, 4.8))
    key = "accuracy"
    for group in groups:
        runs = [r for r in group if r["steps"]]
        if not runs:
            continue
        name = (runs[0]["config"].get("report", {}).get("row") or runs[0]["name"]) + (
            f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        )
        losses = []
        for run in runs:
            window = max(1, len(run["steps"]) // 50)
            smoothed = smooth([s["loss"] for s in run["steps"]], window)
            losses.append(dict(zip((s["step"] for s in run["steps"]), smoothed, strict=True)))
        color = _draw(ax_loss, losses, label=name, linewidth=0.9)
        lm = any("perplexity" in e.get("uncompressed", {}) for r in runs for e in r["evals"])
        key = "perplexity" if lm else "accuracy"
        scale = 100 if key == "accuracy" else 1
        for mode, style in (("uncompressed", "-"), ("compressed", "--")):
            curves = [{e["epoch"]: scale * e[mode][key] for e in r["evals"] if key in e.get(mode, {})} for r in runs]
            if any(curves):
                short = "off" if mode == "uncompressed" else "on"
                _draw(ax_eval, [c for c in curves if c], color=color, linestyle=style, label=f"{name} ({short})")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (running mean)")
    ax_eval.set_xlabel("epoch")
    ax_eval.set_ylabel("test accuracy %" if key == "accuracy" else "eval perplexity")
    if key == "perplexity":
        ax_eval.set_yscale("log")
    ax_loss.legend(fontsize=7)
    ax_eval.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{title} (solid: compression off at inference, dashed: on; band: lowest to highest seed)")
    fig.tight_layout()
    path = out / f"{slug(title)}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
