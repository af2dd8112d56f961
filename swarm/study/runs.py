"""A run as the report reads it: the rows of one results file (`python -m swarm run`, `lab` or
`study`), or a config not run yet; and the figures the tables and findings take from it.

A run is a dict: `path`, `name`, `config` (the config as logged), `steps` and `evals` (its rows of
those types), `summary` (None until the run finished), `state` (finished, partial or pending) and
`stamp` (what produced it, swarm.training.stamp; None for files written before stamps) and
`computing_s` (its time less its pauses, swarm.study.pace; None before a timed row). A row of a
table is the runs of one config at its seeds (`group_seeds`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from swarm.study.pace import computing_seconds
from swarm.study.rows import Row
from swarm.training.results import read_results


def load_run(path: str | Path) -> dict:
    rows = read_results(path)
    config = next((r for r in rows if r["type"] == "config"), None)
    if config is None:
        raise ValueError(f"{path}: no config line (not a results file of `python -m swarm run`)")
    if not isinstance(config.get("name"), str) or not isinstance(config.get("config"), dict):
        raise ValueError(f"{path}: its config line has no run name or no config (not written by `python -m swarm run`)")
    summary = next((r for r in rows if r["type"] == "summary"), None)
    return {
        "path": str(path),
        "name": config["name"],
        "config": config["config"],
        "steps": [r for r in rows if r["type"] == "step"],
        "evals": [r for r in rows if r["type"] == "eval"],
        "summary": summary,
        "state": "finished" if summary else "partial",
        "stamp": config.get("stamp"),
        "computing_s": computing_seconds(rows),
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
        "stamp": None,
        "computing_s": None,
    }


def language(run: dict) -> bool:
    """A language model's run (its table shows eval loss and perplexity): its evaluations report a
    perplexity (any text data, a tokenizer's or bytes); a run not evaluated yet goes by its data."""
    if run["evals"]:
        return "perplexity" in (run["evals"][-1].get("uncompressed") or {})
    return run["config"]["data"]["name"] in ("wikitext2", "text")


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
    return json.dumps([cfg["model"], cfg["data"], cfg["optimizer"], train], sort_keys=True)


def group_seeds(runs: list[dict]) -> list[list[dict]]:
    """The runs of one experiment at different seeds together (same name, same config but the seed), in order."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        config = {k: v for k, v in run["config"].items() if k != "seed"}
        groups.setdefault(json.dumps([run["name"], config], sort_keys=True), []).append(run)
    return list(groups.values())


def finished(group: list[dict]) -> list[dict]:
    return [r for r in group if r["state"] == "finished"]


def per_seed(group: list[dict], figure, *args) -> list[float]:
    """`figure(run, *args)` of each finished run of a row that has it (e.g. best, final, bytes_per_sample)."""
    values = [figure(r, *args) for r in finished(group)]
    return [v for v in values if v is not None]


def as_row(group: list[dict]) -> Row:
    """The figures swarm.study.findings checks (accuracies in %): means over the finished seeds, and each seed's."""
    run = group[0]
    seeds = {
        "acc_off": [100 * v for v in per_seed(group, best, "uncompressed", "accuracy")],
        "acc_on": [100 * v for v in per_seed(group, best, "compressed", "accuracy")],
        "loss_off": per_seed(group, final, "uncompressed", "loss"),
        "loss_on": per_seed(group, final, "compressed", "loss"),
    }
    seeds = {k: v for k, v in seeds.items() if v}
    means = {k: statistics.fmean(v) for k, v in seeds.items()}
    comp = run["config"]["compression"]
    return Row(
        name=run["name"],
        model=run["config"]["model"]["name"],
        forward=comp["forward"],
        backward=comp["backward"],
        warmup=run["config"]["train"].get("warmup_epochs", 0.0),
        finished=bool(finished(group)),
        paper=paper(run),
        seeds=seeds,
        **means,
    )
