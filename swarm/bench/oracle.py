"""`python -m swarm bench oracle CONFIG`: does this config train in the swarm exactly as in one process?

Runs the config through `swarm lab` (separate processes over hivemind on this machine) and in
this process (the in-process transport) with the same torch thread count as each lab peer, then
compares every step's loss and every evaluation's metrics, bit for bit: a swarm's sums are exact
(swarm.engine.exactsum), so with deterministic kernels the two runs give the same floats. A
tolerance (relative) is an explicit option for a model whose kernels are not deterministic (some
GPU ops), and the verdict says which comparison it made. For a model or data of one's own, this is
the check the project's tests make for the built-in ones.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import ExperimentConfig, load_config
from swarm.lab.plan import peer_threads
from swarm.training.experiment import run_experiment
from swarm.training.results import read_results

EXACT = 0.0  # the default comparison: the same bits (a tolerance is for nondeterministic kernels only)


def same_bits(a: float, b: float) -> bool:
    """Whether two float64s are the same bits (0.0 and -0.0 are not; a NaN is itself)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def _relative(a: float, b: float) -> float:
    return 0.0 if same_bits(a, b) else abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a - b) else math.inf


@dataclass
class OracleReport:
    swarm: list[float]
    single: list[float]
    eval_diff: float  # largest relative difference of an evaluation metric (0: all the same bits)
    threads: int
    tolerance: float = EXACT  # relative; EXACT compares bits

    @property
    def loss_diff(self) -> float:
        return max((_relative(a, b) for a, b in zip(self.swarm, self.single, strict=False)), default=0.0)

    @property
    def same(self) -> bool:
        steps_match = len(self.swarm) == len(self.single) > 0
        if self.tolerance == EXACT:
            equal = all(same_bits(a, b) for a, b in zip(self.swarm, self.single, strict=False))
            return steps_match and equal and self.eval_diff == 0.0
        return steps_match and self.loss_diff <= self.tolerance and self.eval_diff <= self.tolerance

    def comparison(self) -> str:
        if self.tolerance == EXACT:
            return "compared bit for bit"
        return f"compared within {self.tolerance:.0e} relative (--tolerance: for kernels that are not deterministic)"


def _eval_diff(ours: list[dict], theirs: list[dict]) -> float:
    evals = [r for r in ours if r["type"] == "eval"]
    reference = [r for r in theirs if r["type"] == "eval"]
    if len(evals) != len(reference):
        return float("inf")
    worst = 0.0
    for a, b in zip(evals, reference, strict=True):
        for mode, metrics in b.items():
            if isinstance(metrics, dict):
                for key, value in metrics.items():
                    got = a.get(mode, {}).get(key)
                    worst = max(worst, math.inf if got is None else _relative(float(got), float(value)))
    return worst


def compare(
    config_path: str, overrides: list[str], stages: int, steps: int, tolerance: float = EXACT, log=print
) -> OracleReport:
    """The lab's run and this process's, `steps` steps each, to compare bit for bit or within
    `tolerance`; raises RuntimeError if the lab fails, ValueError for a negative tolerance."""
    if not tolerance >= 0:
        raise ValueError(f"--tolerance {tolerance}: a relative difference, 0 or more (0: bit for bit)")
    cfg: ExperimentConfig = load_config(config_path, overrides)
    if cfg.compression.adaptive is not None:
        raise ValueError("compression.adaptive decides from measured links: one process has none to compare with")
    threads = peer_threads(stages + 1)
    sets = [a for o in overrides for a in ("--set", o)]
    with tempfile.TemporaryDirectory(prefix="hivepipe-oracle-") as tmp:
        swarm_path, single_path = Path(tmp) / "swarm.jsonl", Path(tmp) / "single.jsonl"
        command = [sys.executable, "-m", "swarm", "lab", config_path, "--stages", str(stages), "--steps", str(steps)]
        log(f"[oracle] swarm: {stages} stage peers and a trainer (python -m swarm lab), {steps} steps")
        lab = subprocess.run([*command, "--results", str(swarm_path), *sets], capture_output=True, text=True)
        if lab.returncode != 0:
            tail = (lab.stderr.strip() or lab.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the lab run failed (exit {lab.returncode}): {tail[0]}")
        log(f"[oracle] one process, {threads} torch thread(s) as each lab peer")
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            single_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"num_stages": stages})})
            run_experiment(single_cfg, single_path, steps, progress=False)
        finally:
            torch.set_num_threads(before)
        ours, theirs = read_results(swarm_path), read_results(single_path)
    losses = [[r["loss"] for r in rows if r["type"] == "step"] for rows in (ours, theirs)]
    return OracleReport(losses[0], losses[1], _eval_diff(ours, theirs), threads, tolerance)


def format_report(report: OracleReport) -> str:
    lines = ["step  swarm loss            one process           relative difference"]
    for step, (a, b) in enumerate(zip(report.swarm, report.single, strict=False), 1):
        lines.append(f"{step:>4}  {a!r:<20}  {b!r:<20}  {_relative(a, b):.2e}")
    verdict = "the same run" if report.same else "NOT the same run"
    lines.append(
        f"largest relative difference: losses {report.loss_diff:.2e}, evaluations {report.eval_diff:.2e}: "
        f"{verdict}, {report.comparison()}"
    )
    return "\n".join(lines)
