"""`python -m swarm bench scale-lab CONFIG`: lab points of a link-bound swarm (every peer its own
shaped link, `swarm lab --replicas`), each a row of docs/bench/scale.json (kind "lab") with the
scale model's prediction beside it (swarm.bench.scale_lab_figures).

Each point is a real swarm run for a few steps (`steps_for`: a warm-up step and about `seconds`
of steady steps at the model's first estimate), its timeline written (every peer's gather span),
its stage peers' memory read every `MEMORY_EVERY_S` seconds while it runs.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.bench.peer_memory import sample_groups
from swarm.bench.scale_lab import LabSetup, LabTraffic, LabTrain, lab_samples_per_s
from swarm.bench.scale_lab_figures import LabPoint, LabRun, StageParams, lab_row
from swarm.bench.throughput import LabLines, _first_sample, input_bytes_per_sample
from swarm.bench.throughput_figures import WARMUP_STEPS
from swarm.config import load_config
from swarm.lab.launch import Lab
from swarm.lab.plan import LinkOptions, RunOptions, parse_replicas
from swarm.models.registry import build_model
from swarm.training.results import read_results

MEMORY_EVERY_S = 2.0
MAX_STEPS = 40


@dataclass(frozen=True)
class ScaleLabPlan:
    """What `bench scale-lab` runs: `config` (with `overrides`) at each (stages, replicas spec) of
    `points`, every process's link `bandwidth_mbit` each way and `delay_ms` one way, about
    `seconds` of steady steps each."""

    config: str
    points: list[tuple[int, str]]
    bandwidth_mbit: float = 10.0
    delay_ms: float = 0.0
    seconds: float = 60.0
    overrides: list[str] = field(default_factory=list)
    stamp: dict = field(default_factory=dict)  # what ran: the commit and date, kept with each run


def stage_params(config: str, overrides: list[str]) -> StageParams:
    """Each stage's trained parameters of the config's model (fp32 bytes, tensors)."""
    cfg = load_config(config, overrides)
    model = build_model(cfg.model.name, cfg.model.num_stages, **cfg.model.options)
    trained = [[p for p in stage.parameters() if p.requires_grad] for stage in model.stages]
    return StageParams([4.0 * sum(p.numel() for p in ps) for ps in trained], [len(ps) for ps in trained])


def boundary_bytes(config: str, overrides: list[str]) -> list[float]:
    """Bytes per sample each boundary carries (a stage's output for one sample), before any run."""
    cfg, x = _first_sample(config, tuple(overrides))
    model = build_model(cfg.model.name, cfg.model.num_stages, **cfg.model.options)
    sizes, out = [], x.unsqueeze(0)
    with torch.no_grad():
        for stage in model.stages[:-1]:
            out = stage(out)
            sizes.append(float(out.numel() * out.element_size()))
    return sizes


def steps_for(plan: ScaleLabPlan, point: LabPoint, overrides: list[str]) -> int:
    """A warm-up step and about `plan.seconds` of steady ones at the model's estimate (payloads
    from the model's shapes, 6% on the wire, 1 ms of compute a sample), 3 to MAX_STEPS."""
    train = load_config(plan.config, overrides).train
    sizes = [b * 1.06 for b in boundary_bytes(plan.config, overrides)]
    setup = LabSetup(
        point.stages,
        [point.replicas[s] for s in range(point.stages)],
        plan.bandwidth_mbit,
        plan.delay_ms,
        [1.0] * point.stages,
        LabTraffic(sizes, sizes),
        LabTrain(train.batch_size, train.micro_batches, train.in_flight),
    )
    estimate = lab_samples_per_s(setup)
    return max(3, min(MAX_STEPS, WARMUP_STEPS + math.ceil(plan.seconds * estimate / train.batch_size)))


class PeakMemory:
    """Each stage peer's peak memory (MiB: its RSS and private pages, its p2pd's RSS) while a lab runs."""

    def __init__(self, lab: Lab) -> None:
        self.lab, self.peaks = lab, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="scale-lab-memory", daemon=True)

    def _watch(self) -> None:
        while not self.done.wait(MEMORY_EVERY_S):
            names = {p.pid: name for name, p in list(self.lab.processes) if name.startswith("stage")}
            for pgid, parts in sample_groups(names).items():
                now = {"rss": parts["peer"].rss, "private": parts["peer"].private, "p2pd": parts["daemon"].rss}
                old = self.peaks.get(names[pgid], {})
                self.peaks[names[pgid]] = {k: max(v, old.get(k, 0.0)) for k, v in now.items()}

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def run_point(plan: ScaleLabPlan, stages: int, replicas: str, directory: Path, log: Callable[[str], None]) -> dict:
    """One point's row (RuntimeError if its run failed); its run's files stay in `directory`."""
    point = LabPoint(stages, parse_replicas(replicas, stages), plan.bandwidth_mbit, plan.delay_ms)
    overrides = [*plan.overrides, f"model.num_stages={stages}"]
    steps = steps_for(plan, point, overrides)
    stem = directory / f"{stages}x{replicas}"
    run = RunOptions(
        f"{stem}.jsonl",
        steps,
        list(plan.overrides),
        trainer_args=["--timeout", "900"],
        trace=f"{stem}.trace.json",
        replicas=replicas,
    )
    links = LinkOptions(f"{plan.bandwidth_mbit}mbit", f"{plan.delay_ms}ms" if plan.delay_ms else None, probe=False)
    log(f"== {stages} stages, replicas {replicas} ({point.peers} stage peers): {steps} steps")
    lab = Lab(plan.config, stages, run, links, LabLines(log))
    load = os.getloadavg()[0]
    with PeakMemory(lab) as memory:
        code = lab.run()
    if code != 0:
        raise RuntimeError(f"the lab run of {stages} stages, replicas {replicas} failed (exit code {code})")
    about = {
        "point": [stages, replicas],
        "stamp": plan.stamp,
        "memory": memory.peaks,
        "load": [round(load, 1), round(os.getloadavg()[0], 1)],
    }
    Path(f"{stem}.lab.json").write_text(json.dumps(about))
    return kept_row(plan, Path(f"{stem}.lab.json"))


def kept_row(plan: ScaleLabPlan, about: Path) -> dict:
    """The row of a run kept in `about`'s directory (`run_point`'s files): the model beside it as the
    code has it now. The load before and after the run is the machine's: it is shared."""
    kept = json.loads(about.read_text())
    stages, replicas = kept["point"]
    point = LabPoint(stages, parse_replicas(replicas, stages), plan.bandwidth_mbit, plan.delay_ms)
    overrides = [*plan.overrides, f"model.num_stages={stages}"]
    stem = about.parent / f"{stages}x{replicas}"
    timelines = {p.stem: json.loads(p.read_text()) for p in Path(f"{stem}.trace.json.parts").glob("*.json")}
    run = LabRun(
        read_results(f"{stem}.jsonl"), timelines, kept["memory"], input_bytes_per_sample(plan.config, overrides)
    )
    return {**lab_row(point, run, stage_params(plan.config, overrides)), "load": kept["load"], **kept["stamp"]}


def run_scale_lab(plan: ScaleLabPlan, keep: str | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Every point's row, in `plan.points`' order; the runs' files kept in `keep` (None: not kept)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="hivepipe-scale-lab-") as tmp:
        directory = Path(keep or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        for stages, replicas in plan.points:
            rows.append(row := run_point(plan, stages, replicas, directory, log))
            log(row_line(row))
    return rows


def kept_rows(plan: ScaleLabPlan, directory: str) -> list[dict]:
    """The rows of the runs kept in `directory` (`run_scale_lab`'s `keep`), in `plan.points`' order."""
    rows = []
    for stages, replicas in plan.points:
        about = Path(directory) / f"{stages}x{replicas}.lab.json"
        if not about.exists():
            raise RuntimeError(f"{about}: no kept run of {stages} stages, replicas {replicas}")
        rows.append(kept_row(plan, about))
    return rows


def row_line(row: dict) -> str:
    routed = "; ".join(f"stage {s}: {'/'.join(map(str, c))}" for s, c in row["micro_batches_per_replica"].items())
    averaging = (
        f"all-reduce {row['allreduce_s']:.2f} s in groups of {row['allreduce_group']}"
        if row["allreduce_s"]
        else "no all-reduce"
    )
    return (
        f"   {row['samples_per_s']:.2f} samples/s, model {row['model_samples_per_s']:.2f} ({100 * row['model_error']:+.0f}%); "
        f"{averaging}; micro-batches per replica {routed}; peak RSS per stage peer {row['rss_mib_per_peer']} MiB"
    )


def write_lab_rows(path: Path, rows: list[dict]) -> None:
    """The file's other rows kept (the model's), its lab rows replaced by `rows`."""
    kept = [r for r in json.loads(path.read_text()) if r.get("kind") != "lab"] if path.exists() else []
    path.write_text(json.dumps(rows + kept, indent=1) + "\n")
