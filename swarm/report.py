"""`python -m swarm report RESULTS...`: paper-shaped markdown tables and PNG curves.

Runs are grouped into tables by their config's `report.table`; each row shows test accuracy
with compression off and on (the paper's Tables 1-4) or eval loss and perplexity (Table 5),
the paper's figures when the config carries them, and the wire bytes per training sample.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from swarm.results import read_results


def _run(path: str) -> dict:
    rows = read_results(path)
    config = next((r for r in rows if r["type"] == "config"), None)
    if config is None:
        raise ValueError(f"{path}: no config line (not a results file of `python -m swarm run`)")
    return {
        "path": path,
        "name": config["name"],
        "config": config["config"],
        "steps": [r for r in rows if r["type"] == "step"],
        "evals": [r for r in rows if r["type"] == "eval"],
        "summary": next((r for r in rows if r["type"] == "summary"), None),
    }


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _best(run: dict, mode: str, key: str):
    summary = run["summary"] or {}
    best = (summary.get("best") or {}).get(mode) or {}
    return best.get(key)


def _final(run: dict, mode: str, key: str):
    final = (run["summary"] or {}).get("final") or (run["evals"][-1] if run["evals"] else {})
    return (final.get(mode) or {}).get(key)


def _links(run: dict) -> str:
    comp = run["config"]["compression"]
    text = f"{comp['forward']} / {comp['backward']}"
    if comp.get("boundaries"):
        text += " (per-boundary overrides)"
    return text


def _bytes_per_sample(run: dict) -> float | None:
    summary = run["summary"]
    if not summary or not summary.get("bytes_per_sample"):
        return None
    return sum(summary["bytes_per_sample"].values())


def _table(title: str, runs: list[dict]) -> list[str]:
    language = any(r["config"]["data"]["name"] == "wikitext2" for r in runs)
    paper_keys = sorted({k for r in runs for k in r["config"].get("report", {}).get("paper", {})})
    if language:
        head = ["run", "fw / bw", "eval loss (off)", "eval loss (on)", "perplexity (off)", "perplexity (on)"]
    else:
        head = ["run", "fw / bw", "test acc % (off)", "test acc % (on)"]
    head += [f"paper: {k}" for k in paper_keys] + ["wire KB / sample", "steps"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        label = run["config"].get("report", {}).get("row") or run["name"]
        cells = [label, _links(run)]
        if language:
            cells += [_fmt(_final(run, "uncompressed", "loss"), ".3f"), _fmt(_final(run, "compressed", "loss"), ".3f")]
            cells += [_fmt(_final(run, "uncompressed", "perplexity")), _fmt(_final(run, "compressed", "perplexity"))]
        else:
            for mode in ("uncompressed", "compressed"):
                acc = _best(run, mode, "accuracy")
                cells.append(_fmt(None if acc is None else 100 * acc))
        paper = run["config"].get("report", {}).get("paper", {})
        cells += [_fmt(paper.get(k)) for k in paper_keys]
        per_sample = _bytes_per_sample(run)
        cells += [_fmt(None if per_sample is None else per_sample / 1024, ".1f"), str(len(run["steps"]))]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _plot(title: str, runs: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        label = run["config"].get("report", {}).get("row") or run["name"]
        steps = run["steps"]
        ax_loss.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=label, linewidth=1)
        key = "perplexity" if run["config"]["data"]["name"] == "wikitext2" else "accuracy"
        evals = [e for e in run["evals"] if key in e.get("uncompressed", {})]
        line = ax_eval.plot([e["epoch"] for e in evals], [e["uncompressed"][key] for e in evals], label=f"{label} (off)")
        if any("compressed" in e for e in evals):
            ax_eval.plot([e["epoch"] for e in evals if "compressed" in e], [e["compressed"][key] for e in evals if "compressed" in e], linestyle="--", color=line[0].get_color(), label=f"{label} (on)")
        ax_eval.set_ylabel(key)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_yscale("log")
    ax_eval.set_xlabel("epoch")
    ax_loss.legend(fontsize=7)
    ax_eval.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
    path = out / f"{slug}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(paths: list[str], out_dir: str) -> list[Path]:
    """Write results.md and one PNG per table into out_dir; returns the files written."""
    runs = [_run(p) for p in paths]
    tables: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        tables[run["config"].get("report", {}).get("table", "Runs")].append(run)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Results", "", "Test accuracy is the best over evaluations; 'off'/'on' = inference with compression off/on.", ""]
    written = []
    for title, group in tables.items():
        lines += _table(title, group)
        png = _plot(title, group, out)
        lines += [f"![{title}]({png.name})", ""]
        written.append(png)
    md = out / "results.md"
    md.write_text("\n".join(lines))
    return [md, *written]
