"""`python -m swarm report [RESULTS...]`: paper-shaped markdown tables, next to the paper's figures.

Runs are grouped into tables by their config's `report.table`; each row shows test accuracy
with compression off and on (the paper's Tables 1-4) or eval loss and perplexity (Table 5), the
paper's figures when the config carries them, and the wire bytes per training sample. A table
without an uncompressed row borrows the one of the same setup (model, data, optimizer, training)
from another table, as the paper repeats its baseline in every table.

Without results files, `write_study_report` reports a study directory (`python -m swarm study`):
every config is a row, those not finished yet shown as pending, and `README.md` adds the reading
of the paper's findings (swarm.study.findings) from the finished rows.
"""

from __future__ import annotations

import datetime
import json
from collections import defaultdict
from pathlib import Path

from swarm.study.findings import MARGIN, Row, check_all, format_findings
from swarm.training.results import read_results


def load_run(path: str | Path) -> dict:
    rows = read_results(path)
    config = next((r for r in rows if r["type"] == "config"), None)
    if config is None:
        raise ValueError(f"{path}: no config line (not a results file of `python -m swarm run`)")
    summary = next((r for r in rows if r["type"] == "summary"), None)
    return {
        "path": str(path),
        "name": config["name"],
        "config": config["config"],
        "steps": [r for r in rows if r["type"] == "step"],
        "evals": [r for r in rows if r["type"] == "eval"],
        "summary": summary,
        "state": "finished" if summary else "partial",
    }


def pending_run(cfg) -> dict:
    """A config with no results yet: a row with the paper's figures and nothing measured."""
    return {
        "path": None,
        "name": cfg.name,
        "config": cfg.model_dump(mode="json"),
        "steps": [],
        "evals": [],
        "summary": None,
        "state": "pending",
    }


# ---- measured figures --------------------------------------------------------------------------


def language(run: dict) -> bool:
    return run["config"]["data"]["name"] == "wikitext2"


def best(run: dict, mode: str, key: str) -> float | None:
    """Best over the evaluations (the paper's tables report the best test accuracy)."""
    summary = run["summary"] or {}
    return ((summary.get("best") or {}).get(mode) or {}).get(key)


def final(run: dict, mode: str, key: str) -> float | None:
    final_eval = (run["summary"] or {}).get("final") or {}
    return (final_eval.get(mode) or {}).get(key)


def bytes_per_sample(run: dict) -> float | None:
    summary = run["summary"]
    if not summary or not summary.get("bytes_per_sample"):
        return None
    return sum(summary["bytes_per_sample"].values())


def links(run: dict) -> str:
    comp = run["config"]["compression"]
    text = f"{comp['forward']} / {comp['backward']}"
    if comp.get("boundaries"):
        text += " (per-boundary overrides)"
    return text


def label(run: dict) -> str:
    return run["config"].get("report", {}).get("row") or run["name"]


def paper(run: dict) -> dict[str, float]:
    return run["config"].get("report", {}).get("paper", {}) or {}


def uncompressed(run: dict) -> bool:
    comp = run["config"]["compression"]
    return comp["forward"] == "none" and comp["backward"] == "none" and not comp.get("boundaries")


def setup_key(run: dict) -> str:
    """What must match for two runs to share a baseline: everything but compression and labels."""
    cfg = run["config"]
    train = {k: v for k, v in cfg["train"].items() if k != "warmup_epochs"}
    return json.dumps([cfg["model"], cfg["data"], cfg["optimizer"], train, cfg["seed"]], sort_keys=True)


def as_row(run: dict) -> Row:
    """The figures swarm.study.findings checks (accuracies in %)."""
    done = run["state"] == "finished"

    def pct(value):
        return None if value is None else 100 * value

    comp = run["config"]["compression"]
    return Row(
        name=run["name"],
        model=run["config"]["model"]["name"],
        forward=comp["forward"],
        backward=comp["backward"],
        warmup=run["config"]["train"].get("warmup_epochs", 0.0),
        finished=done,
        acc_off=pct(best(run, "uncompressed", "accuracy")) if done else None,
        acc_on=pct(best(run, "compressed", "accuracy")) if done else None,
        loss_off=final(run, "uncompressed", "loss") if done else None,
        loss_on=final(run, "compressed", "loss") if done else None,
        paper=paper(run),
    )


# ---- tables ------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _state(run: dict) -> str:
    if run["state"] == "finished":
        return str(run["summary"]["steps"])
    if run["state"] == "partial":
        return f"running ({len(run['steps'])} so far)"
    return "pending"


PAPER_COLUMNS = {
    "acc_off": "paper (off)",
    "acc_on": "paper (on)",
    "eval_loss": "paper: eval loss",
    "perplexity": "paper: perplexity",
}


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


def render(runs: list[dict], out: Path, heading: str) -> tuple[list[str], list[Path]]:
    """results.md lines and the PNGs written: one table and one figure per report.table."""
    from swarm.study.plots import plot_table

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


def write_report(paths: list[str], out_dir: str) -> list[Path]:
    """Write results.md and one PNG per table into out_dir; returns the files written."""
    runs = [load_run(p) for p in paths]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines, pngs = render(runs, out, "# Results")
    md = out / "results.md"
    md.write_text("\n".join(lines))
    return [md, *pngs]


# ---- a study -----------------------------------------------------------------------------------


def study_runs(config_dir: str | Path, results_dir: str | Path) -> list[dict]:
    """Every config of a study as a run: finished, partial (results so far) or pending."""
    from swarm.study.runner import discover, status

    runs = []
    for entry in discover(config_dir, results_dir):
        if entry.cfg is None:
            raise ValueError(f"{entry.config_path}: {entry.error}")
        state = status(entry).state
        run = None
        if state in ("finished", "partial", "pending") and entry.results.is_file():
            try:
                run = load_run(entry.results)
            except ValueError:  # a file cut short mid-line by a kill: the run shows as pending
                run = None
        if run is None or (state != "finished" and not run["steps"]):
            run = pending_run(entry.cfg)  # also stale results (of an older config): only the paper's figures
        elif state != "finished":
            run["state"] = "partial"
        runs.append(run)
    return runs


def caveats(runs: list[dict]) -> list[str]:
    """The scale caveats, with the numbers of the study's own configs."""
    lines = ["## Scale and caveats", ""]
    resnet = next((r["config"] for r in runs if r["config"]["model"]["name"] == "resnet18"), None)
    if resnet is not None:
        width = resnet["model"].get("options", {}).get("width", 64)
        opts = resnet["data"].get("options", {})
        train_size = (
            f"a fixed {opts['subset']:,}-image class-balanced CIFAR-10 subset" if opts.get("subset") else "CIFAR-10"
        )
        test_size = f"{opts['test_subset']:,}" if opts.get("test_subset") else "10,000"
        lines += [
            f"- **Much smaller than the paper.** ResNet-18 at width {width} (about 1/{(64 / width) ** 2:.0f} of the compute of width 64) on",
            f"  {train_size} for {resnet['train']['epochs']:g} epochs, against width 64 on all 50,000 images for 100 epochs.",
            "  Absolute accuracies are far below the paper's ~93%: compare each row with our own baseline (the",
            '  "(on) − baseline" columns), not with the paper\'s absolute numbers.',
            f"- **One seed, {test_size} test images.** The paper reports the best of 5 runs (Tables 1-2) or one run (Tables",
            f"  3-4) on 10,000 test images. Differences below ~{MARGIN:g} points here are noise; the findings use that margin.",
            "- **Short training changes what compression does.** The paper explains compressed inference beating",
            "  uncompressed inference by the model adapting to the compressed distribution over 100 epochs; here it",
            f"  has {resnet['train']['epochs']:g}.",
            '- **Warmup.** "warmup N%" trains the first N% of the epochs uncompressed within the same run (the paper',
            "  restarted from its baseline's weights after N of 100 epochs: the same share).",
        ]
    gpt2 = next((r["config"] for r in runs if r["config"]["model"]["name"] == "gpt2"), None)
    if gpt2 is not None:
        arch = gpt2["model"].get("options", {}).get("config", {})
        pretrained = gpt2["model"].get("options", {}).get("pretrained")
        steps = gpt2["train"].get("max_steps")
        block = gpt2["data"].get("options", {}).get("block_size", 1024)
        if pretrained:
            lines.append(f"- **The transformer** is fine-tuned from {pretrained}.")
        else:
            lines += [
                "- **The transformer is not the paper's.** No pretrained GPT-2 weights exist on this machine, so Table 5",
                f"  here trains a {arch.get('n_layer', 12)}-layer, {arch.get('n_embd', 768)}-wide GPT-2 from scratch"
                + (f" for {steps} steps of {gpt2['train']['batch_size']} x {block} tokens" if steps else ""),
                "  on local WikiText-2 text. The paper fine-tuned pretrained GPT-2 small for 4 epochs and attributes the",
                "  divergence of independent TopK to the pretrained weights, which this setup cannot test. Losses here",
                "  are those of a barely trained model (a uniform guess over GPT-2's vocabulary is 10.8 nats).",
            ]
            data = gpt2["data"].get("options", {})
            if data.get("train_file") and data.get("train_file") == data.get("test_file"):
                lines.append(
                    f"  Only {data['train_file']} exists here: its first {data.get('train_fraction', 0.9):.0%} of rows train, the rest evaluate."
                )
    lines += [
        "- **Bytes are measured, not computed.** Wire KB / sample is what the codecs serialized, including TopK",
        "  indices (bitmap or varint gaps, whichever is smaller), quantization ranges and headers, and it includes",
        "  the uncompressed warmup epochs of the warmup rows. EF21 and AQ-SGD send compressed differences.",
        "",
    ]
    return lines


def write_study_report(config_dir: str | Path, results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """results.md, PNGs and README.md (the reading of the paper's findings) for a study."""
    runs = study_runs(config_dir, results_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines, pngs = render(runs, out, "# CPU-scale study: results next to the paper's tables")
    md = out / "results.md"
    md.write_text("\n".join(lines))
    finished = [r for r in runs if r["state"] == "finished"]
    unfinished = [r for r in runs if r["state"] != "finished"]
    minutes = sum((r["summary"] or {}).get("wall_time_s", 0.0) for r in finished) / 60
    findings = check_all([as_row(r) for r in runs])
    from swarm.study.rerun import section as swarm_section

    rerun = swarm_section(results_dir, f"{Path(str(results_dir)).as_posix()}-lab")
    readme = [
        "# Reproducing the paper's findings at CPU scale",
        "",
        "*Activations and Gradients Compression for Model-Parallel Training* (Rudakov et al., 2024), Tables 1-5,",
        f"rerun at a scale that fits 2 CPU cores. Configs: `{config_dir}/` (one per row of the paper's tables,",
        "written by its `generate.py`); tables with the paper's figures next to ours: [results.md](results.md).",
        "",
        "```bash",
        f"mkdir -p {results_dir} && nohup nice -n 19 python -m swarm study {config_dir} --results_dir {results_dir} > {Path(str(results_dir)).as_posix()}.log 2>&1 &",
        f"python -m swarm study {config_dir} --results_dir {results_dir} --status   # progress",
        f"python -m swarm report --study {config_dir} --results_dir {results_dir} --out {out_dir}",
        "```",
        "",
        f"Status ({datetime.date.today().isoformat()}): {len(finished)} of {len(runs)} runs finished"
        + (f" in {minutes:.0f} minutes of training" if finished else "")
        + (f"; not finished yet: {', '.join(r['name'] for r in unfinished)}." if unfinished else "."),
        "",
        "## What holds at this scale",
        "",
        f"Each finding is checked from the measured rows only, with a {MARGIN:g}-point margin for accuracy; "
        "'(so far)' marks a verdict from the rows finished so far, 'pending' one that has none of its rows yet.",
        "",
        *format_findings(findings),
        "",
        *caveats(runs),
        *rerun,
        "## Figures",
        "",
        *[f"- [{p.stem}]({p.name})" for p in pngs],
        "",
    ]
    path = out / "README.md"
    path.write_text("\n".join(readme))
    return [md, path, *pngs]
