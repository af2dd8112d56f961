"""Paper-shaped markdown tables of runs, one per `report.table`, with a figure each.

Each row shows test accuracy with compression off and on (the paper's Tables 1-4) or eval loss and
perplexity (Table 5), the paper's figures when the config carries them, and the wire bytes per
training sample. A table without an uncompressed row borrows the one of the same setup (model,
data, optimizer, training) from another table, as the paper repeats its baseline in every table.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from swarm.study.plots import plot_table
from swarm.study.runs import best, bytes_per_sample, final, label, language, links, paper, setup_key, uncompressed

PAPER_COLUMNS = {
    "acc_off": "paper (off)",
    "acc_on": "paper (on)",
    "eval_loss": "paper: eval loss",
    "perplexity": "paper: perplexity",
}


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _state(run: dict) -> str:
    if run["state"] == "finished":
        return str(run["summary"]["steps"])
    if run["state"] == "partial":
        return f"running ({len(run['steps'])} so far)"
    return "pending"


def table(title: str, runs: list[dict], baseline: dict | None = None) -> list[str]:
    """One markdown table; `baseline` (the uncompressed run of the same setup) is the reference row."""
    lm = any(language(r) for r in runs)
    rows = ([baseline] if baseline is not None and baseline not in runs else []) + runs
    reference = baseline if baseline is not None else next((r for r in rows if uncompressed(r)), None)
    paper_keys = [k for k in PAPER_COLUMNS if any(k in paper(r) for r in rows)]
    paper_keys += sorted({k for r in rows for k in paper(r)} - set(paper_keys))
    if lm:
        head = ["row", "fw / bw", "eval loss (off)", "eval loss (on)", "perplexity (off)", "perplexity (on)"]
    else:
        head = ["row", "fw / bw", "test acc % (off)", "test acc % (on)"]
    head += [PAPER_COLUMNS.get(k, f"paper: {k}") for k in paper_keys]
    if reference is not None:
        head += (
            ["(on) − baseline", "paper (on) − baseline"]
            if not lm
            else ["loss (on) − baseline", "paper: loss − baseline"]
        )
    head += ["wire KB / sample", "× smaller", "steps"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref_bytes = bytes_per_sample(reference) if reference is not None else None
    for run in rows:
        done = run["state"] == "finished"
        cells = [label(run), links(run).replace("|", "\\|")]
        if lm:
            cells += [_fmt(final(run, m, "loss") if done else None, ".3f") for m in ("uncompressed", "compressed")]
            cells += [_fmt(final(run, m, "perplexity") if done else None) for m in ("uncompressed", "compressed")]
        else:
            for mode in ("uncompressed", "compressed"):
                acc = best(run, mode, "accuracy") if done else None
                cells.append(_fmt(None if acc is None else 100 * acc))
        cells += [_fmt(paper(run).get(k)) for k in paper_keys]
        if reference is not None:
            if lm:
                ours, base = final(run, "compressed", "loss") if done else None, final(reference, "compressed", "loss")
                theirs, their_base = paper(run).get("eval_loss"), paper(reference).get("eval_loss")
            else:
                ours, base = (
                    best(run, "compressed", "accuracy") if done else None,
                    best(reference, "compressed", "accuracy"),
                )
                ours, base = (None if v is None else 100 * v for v in (ours, base))
                theirs, their_base = paper(run).get("acc_on"), paper(reference).get("acc_on")
            cells.append(_fmt(None if ours is None or base is None else ours - base, "+.2f"))
            cells.append(_fmt(None if theirs is None or their_base is None else theirs - their_base, "+.2f"))
        per_sample = bytes_per_sample(run) if done else None
        cells.append(_fmt(None if per_sample is None else per_sample / 1024, ".1f"))
        cells.append(_fmt(None if not per_sample or not ref_bytes else ref_bytes / per_sample, ".1f"))
        cells.append(_state(run))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def setup_line(run: dict) -> str:
    """The scale a table was measured at, from its config."""
    cfg = run["config"]
    model, data, train, opt = cfg["model"], cfg["data"], cfg["train"], cfg["optimizer"]
    options = model.get("options", {})
    if model["name"] == "resnet18":
        what = f"ResNet-18 width {options.get('width', 64)}, {model['num_stages']} stages"
    elif model["name"] == "gpt2":
        arch = options.get("config", {})
        what = (
            "GPT-2 "
            + (f"{arch.get('n_layer', 12)} layers x {arch.get('n_embd', 768)} wide" if arch else "")
            + (f" from {options['pretrained']}" if "pretrained" in options else ", trained from scratch")
        )
        what += f", {model['num_stages']} stages"
    else:
        what = f"{model['name']}, {model['num_stages']} stages"
    d_opts = data.get("options", {})
    sizes = ", ".join(
        f"{k} {v}" for k, v in d_opts.items() if k in ("subset", "test_subset", "block_size", "train_size")
    )
    length = f"{train['epochs']:g} epochs" + (
        f" (at most {train['max_steps']} steps)" if train.get("max_steps") else ""
    )
    return (
        f"{what}; {data['name']}"
        + (f" ({sizes})" if sizes else "")
        + f"; {length}, batch {train['batch_size']}; {opt['name']} lr {opt['lr']:g} {opt['schedule']}; seed {cfg['seed']}"
    )


def group(runs: list[dict]) -> dict[str, list[dict]]:
    tables: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        tables[run["config"].get("report", {}).get("table", "Runs")].append(run)
    return dict(tables)


def baselines(runs: list[dict]) -> dict[str, dict]:
    """setup key -> the uncompressed run of that setup (the first one)."""
    out: dict[str, dict] = {}
    for run in runs:
        if uncompressed(run):
            out.setdefault(setup_key(run), run)
    return out


def results_page(runs: list[dict], out: Path, heading: str) -> tuple[list[str], list[Path]]:
    """results.md lines and the PNGs written into `out`: one table and one figure per report.table."""
    refs = baselines(runs)
    lines = [
        heading,
        "",
        "Test accuracy is the best over evaluations; perplexity and eval loss are the final evaluation.",
        "'off' / 'on' = inference with compression off / on. Wire KB / sample: all boundaries, both directions,",
        "the serialized payloads (values, indices, ranges, headers) per training sample; × smaller: against the",
        "uncompressed row. Paper columns are the paper's own figures (its scale, not ours).",
        "",
    ]
    pngs = []
    for title, members in group(runs).items():
        base = next((refs[k] for k in [setup_key(members[0])] if k in refs), None)
        lines += table(title, members, base)
        lines += [f"Setup: {setup_line(members[0])}.", ""]
        curves = ([base] if base is not None and base not in members else []) + members
        if any(r["steps"] for r in curves):
            png = plot_table(title, curves, out)
            lines += [f"![{title}]({png.name})", ""]
            pngs.append(png)
    return lines, pngs
