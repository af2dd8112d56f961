"""A study row re-run through the real swarm (`python -m swarm lab`), next to its single-process run.

The swarm must compute what one process computes: same per-step training losses, same
evaluations, same bytes on every boundary. `compare` measures how far apart the two runs are;
`section` is the markdown the study report adds for every row that has a swarm re-run:

    python -m swarm lab configs/study-cpu/ROW.yaml --stages 4 --results runs/study-cpu-lab/ROW.jsonl
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm.config import ExperimentConfig
from swarm.study.entries import same_config
from swarm.study.runs import load_run


@dataclass
class Comparison:
    name: str
    steps: int  # optimizer steps both runs have
    max_loss_rel: float  # largest relative difference of a step's training loss
    evals: list[tuple[int, dict, dict]]  # (step, single-process eval, swarm eval) at common eval steps
    bytes_single: dict[str, int]
    bytes_swarm: dict[str, int]
    wall_single: float | None
    wall_swarm: float | None


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _bytes(run: dict) -> dict[str, int]:
    summary = run["summary"] or {}
    return dict(summary.get("bytes") or {})


def compare(single: dict, swarm: dict) -> Comparison:
    """Runs as `swarm.study.runs.load_run` returns them; raises if they are not the same experiment."""
    if not same_config(swarm["config"], ExperimentConfig.model_validate(single["config"])):
        differing = sorted(
            k for k in set(single["config"]) | set(swarm["config"]) if single["config"].get(k) != swarm["config"].get(k)
        )
        raise ValueError(
            f"{swarm['path']} is not a re-run of {single['path']}: the configs differ in {', '.join(differing)}"
        )
    mine = {r["step"]: r["loss"] for r in single["steps"]}
    theirs = {r["step"]: r["loss"] for r in swarm["steps"]}
    common = sorted(set(mine) & set(theirs))
    if not common:
        raise ValueError(f"{swarm['path']} and {single['path']} have no optimizer step in common")
    evals_single = {r["step"]: r for r in single["evals"]}
    evals = [(r["step"], evals_single[r["step"]], r) for r in swarm["evals"] if r["step"] in evals_single]
    return Comparison(
        name=single["name"],
        steps=len(common),
        max_loss_rel=max(_relative(mine[s], theirs[s]) for s in common),
        evals=evals,
        bytes_single=_bytes(single),
        bytes_swarm=_bytes(swarm),
        wall_single=(single["summary"] or {}).get("wall_time_s"),
        wall_swarm=(swarm["summary"] or {}).get("wall_time_s"),
    )


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def section(results_dir: str | Path, lab_dir: str | Path) -> list[str]:
    """Markdown for every finished swarm re-run in `lab_dir` with a single-process run in `results_dir`."""
    lab = Path(lab_dir)
    pairs = []
    for path in sorted(lab.glob("*.jsonl")) if lab.is_dir() else []:
        single_path = Path(results_dir) / path.name
        if not single_path.is_file():
            continue
        swarm = load_run(path)
        if swarm["state"] != "finished":
            continue
        pairs.append(compare(load_run(single_path), swarm))
    if not pairs:
        return []
    lines = [
        "## The same rows through the real swarm",
        "",
        "Re-run with `python -m swarm lab CONFIG --stages 4`: a bootstrap, four stage peers and a trainer as",
        "separate processes on hivemind's DHT and libp2p (loopback), compressed payloads on the wire.",
        "",
        "| row | steps | max rel. loss diff | last eval step | acc off (1 process / swarm) | acc on (1 process / swarm) | wire bytes equal | wall time (1 process / swarm) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in pairs:
        step, a, b = c.evals[-1] if c.evals else (None, {}, {})
        acc = [
            f"{_pct(a.get(m, {}).get('accuracy'))} / {_pct(b.get(m, {}).get('accuracy'))}"
            for m in ("uncompressed", "compressed")
        ]
        same_bytes = "yes" if c.bytes_single == c.bytes_swarm else "no"
        walls = f"{c.wall_single or 0:.0f} s / {c.wall_swarm or 0:.0f} s"
        lines.append(
            f"| {c.name} | {c.steps} | {c.max_loss_rel:.1e} | {step if step is not None else '–'} | {acc[0]} | {acc[1]} | {same_bytes} | {walls} |"
        )
    lines.append("")
    return lines
