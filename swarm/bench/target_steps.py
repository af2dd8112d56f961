"""bench time-to-target's steps: how many optimizer steps each variant (optimizer, schedule, codec)
needs to reach the target, from one process.

The oracle makes a swarm's losses one process's, whatever the links, so the steps to a target do
not depend on the network: one process (`python -m swarm run --threads 1`) trains each variant the
whole schedule, and the swarm only contributes its seconds per step (swarm.bench.step_time). Runs
are kept in a work directory and reused when a file there holds a finished run of the very same
config, so a benchmark can be resumed, widened or re-tabled without training again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from swarm.bench.gloo.launch import GLOO
from swarm.bench.lab_seconds import reaching
from swarm.bench.throughput import codec_overrides
from swarm.config import load_config
from swarm.config.target import Target
from swarm.training.results import read_results


@dataclass(frozen=True)
class Variant:
    """`optimizer`: a name, or NAME:LR (the rate; muon's AdamW part then at LR/10); `schedule`:
    sync, async (its default correction) or async:CORRECTION; `codec`: as in bench throughput."""

    optimizer: str
    schedule: str
    codec: str

    def overrides(self) -> list[str]:
        name, _, lr = self.optimizer.partition(":")
        sets = [f"optimizer.name={name}"]
        if name != "muon":
            sets.append("optimizer.adamw_lr=null")
        if lr:
            sets.append(f"optimizer.lr={float(lr)}")
        kind, _, correction = self.schedule.partition(":")
        sets.append(f"train.schedule={kind}")
        if correction:
            sets.append(f"train.delay_correction={correction}")
        return sets + codec_overrides(self.codec)[2]

    def check(self) -> None:
        """ValueError in one line for a variant no run can have."""
        if self.codec == GLOO and self.schedule != "sync":
            raise ValueError(f"{GLOO} runs train.schedule: sync only, not {self.schedule}")
        if self.schedule.partition(":")[0] not in ("sync", "async"):
            raise ValueError(f"schedule {self.schedule!r}: expected sync, async or async:CORRECTION")

    @property
    def label(self) -> str:
        return f"{self.optimizer} {self.schedule} {self.codec}"


@dataclass
class Steps:
    """One variant's one-process run against the target."""

    reached: bool
    steps_to_target: int | None  # the step of the first evaluation that reached it
    steps: int  # the steps the run trained
    final: float | None  # the metric at its last evaluation
    curve: list[list[float]] = field(default_factory=list)  # [step, metric] per evaluation
    losses: list[float] = field(default_factory=list)  # per step (the lab's oracle check)


def steps_against(rows: list[dict], target: Target) -> Steps:
    evaluations, first = reaching(rows, target)
    curve = [[step, metric] for _, step, metric in evaluations]
    losses = [r["loss"] for r in rows if r.get("type") == "step"]
    reached = first is not None
    return Steps(
        reached, first["step"] if reached else None, len(losses), curve[-1][1] if curve else None, curve, losses
    )


# Fields only a swarm reads (how many micro-batches the trainer keeps in the pipeline): one process
# trains the same steps whatever they say, so a kept run serves configs that differ only there.
SWARM_ONLY = (("train", "in_flight"),)


def _one_process_view(config: dict) -> dict:
    view = {section: dict(fields) if isinstance(fields, dict) else fields for section, fields in config.items()}
    for section, field_name in SWARM_ONLY:
        if isinstance(view.get(section), dict):
            view[section].pop(field_name, None)
    return view


def _config_of(path: Path) -> dict | None:
    """The config a finished results file ran, swarm-only fields left out (None: unfinished or not
    a results file)."""
    try:
        with path.open() as f:
            head = json.loads(f.readline())
        finished = any(r.get("type") == "summary" for r in read_results(path))
    except (OSError, ValueError):
        return None
    return _one_process_view(head["config"]) if head.get("type") == "config" and finished else None


class StepRuns:
    """One-process runs of `config` under `work`, one per variant (reused when already there)."""

    def __init__(self, config: str, overrides: list[str], work: Path, log=print) -> None:
        self.config, self.overrides, self.work, self.log = config, overrides, Path(work), log
        self.work.mkdir(parents=True, exist_ok=True)

    def sets(self, variant: Variant) -> list[str]:
        return [*self.overrides, *variant.overrides()]

    def path(self, variant: Variant) -> Path:
        """The finished run of exactly this variant's config, or where a new one goes."""
        wanted = _one_process_view(load_config(self.config, self.sets(variant)).model_dump(mode="json"))
        for path in sorted(self.work.glob("*.jsonl")):
            if _config_of(path) == wanted:
                return path
        slug = "-".join(variant.label.replace(":", "").replace("/", "").split())
        return self.work / f"{slug}-{len(list(self.work.glob('*.jsonl')))}.jsonl"

    def run(self, variant: Variant) -> Path:
        path = self.path(variant)
        if _config_of(path) is not None:
            self.log(f"== {variant.label}: one process, kept in {path}")
            return path
        self.log(f"== {variant.label}: one process, the whole schedule -> {path}")
        partial = path.with_suffix(".part")
        command = [sys.executable, "-m", "swarm", "run", self.config, "--threads", "1", "--results", str(partial)]
        for item in self.sets(variant):
            command += ["--set", item]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the one-process run of {variant.label} failed: {last}")
        partial.rename(path)
        return path

    def steps(self, variants: list[Variant], target: Target, jobs: int = 1) -> dict[Variant, Steps]:
        """Each variant's steps (the runs `jobs` at a time, each on one thread)."""
        unique = list(dict.fromkeys(variants))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            paths = list(pool.map(self.run, unique))
        return {v: steps_against(read_results(p), target) for v, p in zip(unique, paths, strict=True)}
