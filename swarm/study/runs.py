"""A run as the report reads it: the rows of one results file (`python -m swarm run`, `lab` or
`study`), or a config not run yet; and the figures the tables and findings take from it.

A run is a dict: `path`, `name`, `config` (the config as logged), `steps` and `evals` (its rows of
those types), `summary` (None until the run finished) and `state` (finished, partial or pending).
"""

from __future__ import annotations

import json
from pathlib import Path

from swarm.study.findings import Row
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
