"""PNG curves for a report table: training loss per step, and the test metric per epoch with
compression off (solid) and on (dashed)."""

from __future__ import annotations

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


def plot_table(title: str, runs: list[dict], out: Path) -> Path:
    # matplotlib, a large import, loads only when a figure is drawn (a report whose runs have no
    # steps yet draws none), and the Agg backend is chosen before pyplot loads: no display needed.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(13, 4.8))
    key = "accuracy"
    for run in runs:
        if not run["steps"]:
            continue
        name = run["config"].get("report", {}).get("row") or run["name"]
        steps = run["steps"]
        window = max(1, len(steps) // 50)
        line = ax_loss.plot(
            [s["step"] for s in steps], smooth([s["loss"] for s in steps], window), label=name, linewidth=0.9
        )
        color = line[0].get_color()
        lm = any("perplexity" in e.get("uncompressed", {}) for e in run["evals"])
        key = "perplexity" if lm else "accuracy"
        evals = [e for e in run["evals"] if key in e.get("uncompressed", {})]
        scale = 100 if key == "accuracy" else 1
        ax_eval.plot(
            [e["epoch"] for e in evals],
            [scale * e["uncompressed"][key] for e in evals],
            color=color,
            label=f"{name} (off)",
        )
        on = [e for e in evals if key in e.get("compressed", {})]
        if on:
            ax_eval.plot(
                [e["epoch"] for e in on],
                [scale * e["compressed"][key] for e in on],
                linestyle="--",
                color=color,
                label=f"{name} (on)",
            )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (running mean)")
    ax_eval.set_xlabel("epoch")
    ax_eval.set_ylabel("test accuracy %" if key == "accuracy" else "eval perplexity")
    if key == "perplexity":
        ax_eval.set_yscale("log")
    ax_loss.legend(fontsize=7)
    ax_eval.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{title} (solid: compression off at inference, dashed: on)")
    fig.tight_layout()
    path = out / f"{slug(title)}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
