"""`python -m swarm report [RESULTS...]`: results.md and one PNG per table (swarm.study.tables).

Without results files, `write_study_report` reports a study directory (`python -m swarm study`):
every config is a row, those not finished yet shown as pending, and `README.md` adds the reading
of the paper's findings (swarm.study.findings) from the finished rows, the scale caveats, and the
rows re-run through the real swarm (swarm.study.rerun).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from swarm.study.entries import discover, status
from swarm.study.findings import MARGIN, check_all, format_findings
from swarm.study.rerun import section as swarm_section
from swarm.study.runs import as_row, group_seeds, load_run, pending_run
from swarm.study.tables import results_page


def write_report(paths: list[str], out_dir: str, mix_commits: bool = False) -> list[Path]:
    """Write results.md and one PNG per table into out_dir; returns the files written."""
    runs = [load_run(p) for p in paths]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines, pngs = results_page(runs, out, "# Results", mix_commits)
    md = out / "results.md"
    md.write_text("\n".join(lines))
    return [md, *pngs]


def study_runs(config_dir: str | Path, results_dir: str | Path) -> list[dict]:
    """Every config of a study at every seed it has results for, as a run: finished, partial
    (results so far) or pending."""
    runs = []
    for entry in discover(config_dir, results_dir, seeds=None):
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
            f"- **Seeds, {test_size} test images.** The paper reports the best of 5 runs (Tables 1-2) or one run (Tables",
            "  3-4) on 10,000 test images. Here each row is the mean ± std over its seeds (the 'seeds' column); a",
            "  finding counts a difference only outside 2 x the pooled std of the rows it compares (swarm.study.noise).",
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


def write_study_report(
    config_dir: str | Path, results_dir: str | Path, out_dir: str | Path, mix_commits: bool = False
) -> list[Path]:
    """results.md, PNGs and README.md (the reading of the paper's findings) for a study."""
    if not Path(results_dir).is_dir():  # a mistyped one would report every row pending
        raise ValueError(f"--results_dir {results_dir} is not a directory (where `swarm study` wrote the runs)")
    runs = study_runs(config_dir, results_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines, pngs = results_page(runs, out, "# CPU-scale study: results next to the paper's tables", mix_commits)
    md = out / "results.md"
    md.write_text("\n".join(lines))
    finished = [r for r in runs if r["state"] == "finished"]
    unfinished = [r for r in runs if r["state"] != "finished"]
    minutes = sum(r["computing_s"] or 0.0 for r in finished) / 60
    findings = check_all([as_row(g) for g in group_seeds(runs)])
    rerun = swarm_section(results_dir, f"{Path(str(results_dir)).as_posix()}-lab")
    readme = [
        "# Reproducing the paper's findings at CPU scale",
        "",
        "*Activations and Gradients Compression for Model-Parallel Training* (Rudakov et al., 2024), Tables 1-5,",
        f"rerun at a scale that fits 2 CPU cores. Configs: `{config_dir}/` (one per row of the paper's tables,",
        "written by its `generate.py`); tables with the paper's figures next to ours: [results.md](results.md).",
        "",
        "```bash",
        f"mkdir -p {results_dir} && nohup nice -n 19 python -m swarm study {config_dir} --results_dir {results_dir} --seeds 3 > {Path(str(results_dir)).as_posix()}.log 2>&1 &",
        f"python -m swarm study {config_dir} --results_dir {results_dir} --seeds 3 --status   # progress, time left",
        f"python -m swarm report --study {config_dir} --results_dir {results_dir} --out {out_dir}",
        "```",
        "",
        "Seeds, stamps, what the verdicts mean, and the scale that fits a 3-seed study: [seeds-and-scale.md](seeds-and-scale.md).",
        "",
        f"Status ({datetime.date.today().isoformat()}): {len(finished)} of {len(runs)} runs finished"
        + (f" in {minutes:.0f} minutes of training" if finished else "")
        + (f"; not finished yet: {', '.join(r['name'] for r in unfinished)}." if unfinished else "."),
        "",
        "## What holds at this scale",
        "",
        "Each finding is checked from the measured rows only: a difference counts when it is outside the noise,",
        "2 x the pooled std over seeds of the rows compared (swarm.study.noise); 'within noise' when it is not,",
        "'not judged: single seed' when a row it compares has one seed (in brackets: the lean with a fixed",
        f"{MARGIN:g}-point / 0.1-nat guess). Claims of closeness keep the paper's {MARGIN:g}-point tolerance. '(so far)'",
        "marks a verdict from the rows finished so far, 'pending' one that has none of its rows yet.",
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
