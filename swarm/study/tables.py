"""Paper-shaped markdown tables of runs, one per `report.table`, with a figure each.

Each row shows test accuracy with compression off and on (the paper's Tables 1-4) or eval loss and
perplexity (Table 5), the paper's figures when the config carries them, and the wire bytes per
training sample. A table without an uncompressed row borrows the one of the same setup (model,
data, optimizer, training) from another table, as the paper repeats its baseline in every table.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from swarm.study.plots import plot_table
from swarm.study.runs import (
    best,
    bytes_per_sample,
    final,
    finished,
    group_seeds,
    label,
    language,
    links,
    paper,
    per_seed,
    setup_key,
    uncompressed,
)
from swarm.study.stamps import check_one_commit, commits, stamp_line

PAPER_COLUMNS = {
    "acc_off": "paper (off)",
    "acc_on": "paper (on)",
    "eval_loss": "paper: eval loss",
    "perplexity": "paper: perplexity",
}


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


ILLUSTRATIVE = "†"  # a row measured at one seed: no spread, only illustrative


def spread(values: list[float], spec: str = ".2f") -> str:
    """mean ± std over seeds; one seed marked illustrative; none: a dash."""
    if not values:
        return "–"
    if len(values) == 1:
        return format(values[0], spec) + ILLUSTRATIVE
    return f"{format(statistics.fmean(values), spec)} ± {format(statistics.stdev(values), spec.lstrip('+'))}"


def _state(group: list[dict]) -> str:
    done = finished(group)
    running = [r for r in group if r["state"] == "partial"]
    text = str(done[0]["summary"]["steps"]) if done else ""
    if running:
        text += (" " if text else "") + f"(running: {len(running[0]['steps'])} so far)"
    return text or "pending"


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _percent(values: list[float]) -> list[float]:
    return [100 * v for v in values]


def table(title: str, groups: list[list[dict]], baseline: list[dict] | None = None, mix: bool = False) -> list[str]:
    """One markdown table, a row per group of seeds; `baseline` (the uncompressed row of the same setup)
    is the reference row. `mix`: the table holds several commits, each row names its own."""
    lm = any(language(g[0]) for g in groups)
    rows = ([baseline] if baseline is not None and baseline not in groups else []) + groups
    reference = baseline if baseline is not None else next((g for g in rows if uncompressed(g[0])), None)
    paper_keys = [k for k in PAPER_COLUMNS if any(k in paper(g[0]) for g in rows)]
    paper_keys += sorted({k for g in rows for k in paper(g[0])} - set(paper_keys))
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
    head += ["wire KB / sample", "× smaller", "seeds", "steps"] + (["commit"] if mix else [])
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref_bytes = _mean(per_seed(reference, bytes_per_sample)) if reference is not None else None
    for group in rows:
        first = group[0]
        cells = [label(first), links(first).replace("|", "\\|")]
        if lm:
            cells += [spread(per_seed(group, final, m, "loss"), ".3f") for m in ("uncompressed", "compressed")]
            cells += [spread(per_seed(group, final, m, "perplexity")) for m in ("uncompressed", "compressed")]
        else:
            cells += [spread(_percent(per_seed(group, best, m, "accuracy"))) for m in ("uncompressed", "compressed")]
        cells += [_fmt(paper(first).get(k)) for k in paper_keys]
        if reference is not None:
            if lm:
                ours = _mean(per_seed(group, final, "compressed", "loss"))
                base = _mean(per_seed(reference, final, "compressed", "loss"))
                theirs, their_base = paper(first).get("eval_loss"), paper(reference[0]).get("eval_loss")
            else:
                ours = _mean(_percent(per_seed(group, best, "compressed", "accuracy")))
                base = _mean(_percent(per_seed(reference, best, "compressed", "accuracy")))
                theirs, their_base = paper(first).get("acc_on"), paper(reference[0]).get("acc_on")
            cells.append(_fmt(None if ours is None or base is None else ours - base, "+.2f"))
            cells.append(_fmt(None if theirs is None or their_base is None else theirs - their_base, "+.2f"))
        per_sample = _mean(per_seed(group, bytes_per_sample))
        cells.append(_fmt(None if per_sample is None else per_sample / 1024, ".1f"))
        cells.append(_fmt(None if not per_sample or not ref_bytes else ref_bytes / per_sample, ".1f"))
        cells += [str(len(finished(group))), _state(group)]
        if mix:
            cells.append(", ".join(commits(group)) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if any(len(finished(g)) == 1 for g in rows):
        lines += [f"{ILLUSTRATIVE} one seed: no spread, illustrative only (the findings do not judge it).", ""]
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
        + f"; {length}, batch {train['batch_size']}; {opt['name']} lr {opt['lr']:g} {opt['schedule']}"
    )


def by_table(groups: list[list[dict]]) -> dict[str, list[list[dict]]]:
    tables: dict[str, list[list[dict]]] = defaultdict(list)
    for group in groups:
        tables[group[0]["config"].get("report", {}).get("table", "Runs")].append(group)
    return dict(tables)


def baselines(groups: list[list[dict]]) -> dict[str, list[dict]]:
    """setup key -> the uncompressed row of that setup (the first one)."""
    out: dict[str, list[dict]] = {}
    for group in groups:
        if uncompressed(group[0]):
            out.setdefault(setup_key(group[0]), group)
    return out


def results_page(runs: list[dict], out: Path, heading: str, mix_commits: bool = False) -> tuple[list[str], list[Path]]:
    """results.md lines and the PNGs written into `out`: one table and one figure per report.table.
    Raises MixedCommits when a table would hold results of different commits and not `mix_commits`."""
    groups = group_seeds(runs)
    refs = baselines(groups)
    lines = [
        heading,
        "",
        "Test accuracy is the best over evaluations; perplexity and eval loss are the final evaluation.",
        "Each figure is the mean ± standard deviation over the row's seeds (column 'seeds'); a figure",
        f"marked {ILLUSTRATIVE} is a single seed, illustrative only.",
        "'off' / 'on' = inference with compression off / on. Wire KB / sample: all boundaries, both directions,",
        "the serialized payloads (values, indices, ranges, headers) per training sample; × smaller: against the",
        "uncompressed row. Paper columns are the paper's own figures (its scale, not ours).",
        "",
    ]
    pngs = []
    for title, members in by_table(groups).items():
        base = refs.get(setup_key(members[0][0]))
        shown = ([base] if base is not None and base not in members else []) + members
        everything = [r for g in shown for r in g]
        check_one_commit(title, everything, mix_commits)
        lines += table(title, members, base, mix=len(commits(everything)) > 1)
        lines += [f"Setup: {setup_line(members[0][0])}.", ""]
        stamped = stamp_line(everything)
        lines += [stamped, ""] if stamped else []
        if any(r["steps"] for r in everything):
            png = plot_table(title, shown, out)
            lines += [f"![{title}]({png.name})", ""]
            pngs.append(png)
    return lines, pngs
