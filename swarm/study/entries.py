"""The runs of a study: one per (config, seed), where its results and checkpoints go, and its state.

Seed k of config `NAME.yaml` trains with the config's seed + k. Seed 0 is the config as written
and keeps the name it always had, `RESULTS_DIR/NAME.jsonl` (so results from before seeds existed
count as that seed); seed k > 0 writes `RESULTS_DIR/NAME.seed<S>.jsonl` with S the seed it trains
with, and checkpoints into `RESULTS_DIR/checkpoints/NAME.seed<S>/`.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from swarm.config import ConfigError, ExperimentConfig, load_config
from swarm.study.pace import computing_seconds
from swarm.training.checkpoints import latest_run
from swarm.training.results import read_results

CONFIG_FILE = "config.json"  # in a run's checkpoint directory: the config it was written for
_SEED_FILE = re.compile(r"^(?P<row>.+)\.seed(?P<seed>\d+)\.jsonl$")


@dataclass
class Entry:
    """One run of a study: a config at one of its seeds."""

    config_path: Path
    results: Path
    checkpoints: Path
    cfg: ExperimentConfig | None = None  # with the run's seed
    error: str | None = None  # the config does not load
    replicate: int = 0  # the config's seed + this is the run's seed

    @property
    def row(self) -> str:
        """The config's name: every seed of it is one row of a table."""
        return self.config_path.stem

    @property
    def name(self) -> str:
        return self.results.name.removesuffix(".jsonl")


@dataclass
class Status:
    state: str  # finished | partial | pending | stale | invalid
    steps: int = 0  # optimizer steps in the results file
    epoch: float = 0.0
    wall_time_s: float | None = None  # of a finished run
    computing_s: float | None = None  # of a finished run: its wall time less its pauses (swarm.study.pace)
    note: str = ""


def _matches(name: str, patterns: list[str]) -> bool:
    """fnmatch patterns; a pattern without wildcards matches as a substring."""
    if not patterns:
        return True
    return any(fnmatch.fnmatch(name, p if any(c in p for c in "*?[") else f"*{p}*") for p in patterns)


def seeded_entry(path: Path, results_dir: Path, replicate: int) -> Entry:
    """The run of config `path` at its seed + `replicate`."""
    try:
        cfg = load_config(path)
    except ConfigError as e:
        name = path.stem if replicate == 0 else f"{path.stem}.seed{replicate}"
        return Entry(path, results_dir / f"{name}.jsonl", results_dir / "checkpoints" / name, error=str(e))
    seed = cfg.seed + replicate
    name = path.stem if replicate == 0 else f"{path.stem}.seed{seed}"
    if replicate:
        cfg = cfg.model_copy(update={"seed": seed})
    return Entry(path, results_dir / f"{name}.jsonl", results_dir / "checkpoints" / name, cfg, replicate=replicate)


def _found_replicates(path: Path, results_dir: Path) -> list[int]:
    """The replicates of config `path` that have a results file (seed 0 always counts)."""
    try:
        base = load_config(path).seed
    except ConfigError:
        return [0]
    found = {0}
    for result in results_dir.glob(f"{path.stem}.seed*.jsonl"):
        match = _SEED_FILE.match(result.name)
        if match and match["row"] == path.stem and int(match["seed"]) > base:
            found.add(int(match["seed"]) - base)
    return sorted(found)


def discover(
    config_dir: str | Path, results_dir: str | Path, only: list[str] | None = None, seeds: int | None = 1
) -> list[Entry]:
    """The study's runs (`*.yaml` in config_dir, sorted by name, `seeds` per config), filtered by
    `only` (on the config's name). `seeds=None`: the seeds that have results files."""
    config_dir, results_dir = Path(config_dir), Path(results_dir)
    if not config_dir.is_dir():
        raise ValueError(f"{config_dir} is not a directory of configs")
    if seeds is not None and seeds < 1:
        raise ValueError(f"--seeds must be at least 1, not {seeds}")
    entries = []
    for path in sorted(config_dir.glob("*.yaml")):
        if not _matches(path.stem, only or []):
            continue
        replicates = range(seeds) if seeds is not None else _found_replicates(path, results_dir)
        entries += [seeded_entry(path, results_dir, k) for k in replicates]
    return entries


def config_json(cfg: ExperimentConfig) -> dict:
    return json.loads(json.dumps(cfg.model_dump(mode="json")))


def same_config(logged: dict | None, cfg: ExperimentConfig) -> bool:
    """Whether a results file's config row is `cfg`: read through today's config model, so a
    field added since (with its default) does not make every finished run stale."""
    if logged is None:
        return False
    try:
        return config_json(ExperimentConfig.model_validate(logged)) == config_json(cfg)
    except ValueError:  # a field removed or changed meaning since: not the same experiment
        return False


def status(entry: Entry) -> Status:
    """What the results file and the checkpoints say about one run."""
    if entry.error:
        return Status("invalid", note=entry.error)
    rows = []
    if entry.results.is_file():
        try:
            rows = read_results(entry.results)
        except (OSError, ValueError) as e:
            return Status("partial" if latest_run(entry.checkpoints) else "pending", note=f"unreadable results ({e})")
    steps = [r for r in rows if r["type"] == "step"]
    last = steps[-1] if steps else {}
    config = next((r for r in rows if r["type"] == "config"), None)
    if config is not None and not same_config(config.get("config"), entry.cfg):
        return Status(
            "stale", len(steps), last.get("epoch", 0.0), note="the config changed since this run; it runs again"
        )
    summary = next((r for r in rows if r["type"] == "summary"), None)
    if summary is not None:
        wall = summary.get("wall_time_s")
        return Status("finished", summary["steps"], last.get("epoch", 0.0), wall, computing_seconds(rows))
    checkpoint = latest_run(entry.checkpoints)
    if checkpoint is not None and same_config(checkpoint_config(entry), entry.cfg):
        return Status("partial", len(steps), last.get("epoch", 0.0), note=f"resumes from {checkpoint.name}")
    return Status("pending", len(steps), last.get("epoch", 0.0))


def checkpoint_config(entry: Entry) -> dict | None:
    try:
        return json.loads((entry.checkpoints / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
