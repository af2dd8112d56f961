"""`python -m swarm study CONFIG_DIR`: run every config of a study that has not finished, resumably.

Each config `NAME.yaml` writes `RESULTS_DIR/NAME.jsonl` and checkpoints into
`RESULTS_DIR/checkpoints/NAME/`. A run is finished when its results file ends in a summary row
written for the config as it is now; a run with a checkpoint resumes from it (exactly, see
`swarm.training.loop.train`); anything else starts from scratch. Checkpoints of a finished run are deleted.
Stop the study at any time (Ctrl-C, kill, a reboot) and start it again: it picks up where it was,
losing at most the steps since the last evaluation. One study process per results directory (a
lock file refuses a second one).
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from swarm.config import ConfigError, ExperimentConfig, load_config
from swarm.training.checkpoints import Checkpointing, latest_run
from swarm.training.results import read_results

CONFIG_FILE = "config.json"  # in a run's checkpoint directory: the config it was written for


@dataclass
class Entry:
    """One config of a study and where its results and checkpoints go."""

    config_path: Path
    results: Path
    checkpoints: Path
    cfg: ExperimentConfig | None = None
    error: str | None = None  # the config does not load

    @property
    def name(self) -> str:
        return self.config_path.stem


@dataclass
class Status:
    state: str  # finished | partial | pending | stale | invalid
    steps: int = 0  # optimizer steps in the results file
    epoch: float = 0.0
    wall_time_s: float | None = None  # of a finished run
    note: str = ""


def _matches(name: str, patterns: list[str]) -> bool:
    """fnmatch patterns; a pattern without wildcards matches as a substring."""
    if not patterns:
        return True
    return any(fnmatch.fnmatch(name, p if any(c in p for c in "*?[") else f"*{p}*") for p in patterns)


def discover(config_dir: str | Path, results_dir: str | Path, only: list[str] | None = None) -> list[Entry]:
    """The study's configs (`*.yaml` in config_dir, sorted by name), filtered by `only`."""
    config_dir, results_dir = Path(config_dir), Path(results_dir)
    if not config_dir.is_dir():
        raise ValueError(f"{config_dir} is not a directory of configs")
    entries = []
    for path in sorted(config_dir.glob("*.yaml")):
        if not _matches(path.stem, only or []):
            continue
        entry = Entry(path, results_dir / f"{path.stem}.jsonl", results_dir / "checkpoints" / path.stem)
        try:
            entry.cfg = load_config(path)
        except ConfigError as e:
            entry.error = str(e)
        entries.append(entry)
    return entries


def _config_json(cfg: ExperimentConfig) -> dict:
    return json.loads(json.dumps(cfg.model_dump(mode="json")))


def same_config(logged: dict | None, cfg: ExperimentConfig) -> bool:
    """Whether a results file's config row is `cfg`: read through today's config model, so a
    field added since (with its default) does not make every finished run stale."""
    if logged is None:
        return False
    try:
        return _config_json(ExperimentConfig.model_validate(logged)) == _config_json(cfg)
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
        return Status("finished", summary["steps"], last.get("epoch", 0.0), summary.get("wall_time_s"))
    checkpoint = latest_run(entry.checkpoints)
    if checkpoint is not None and same_config(_checkpoint_config(entry), entry.cfg):
        return Status("partial", len(steps), last.get("epoch", 0.0), note=f"resumes from {checkpoint.name}")
    return Status("pending", len(steps), last.get("epoch", 0.0))


def _checkpoint_config(entry: Entry) -> dict | None:
    try:
        return json.loads((entry.checkpoints / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None


def _prepare_checkpoints(entry: Entry) -> None:
    """Checkpoints written for another version of the config are dropped; the current one is recorded."""
    wanted = _config_json(entry.cfg)
    if entry.checkpoints.exists() and not same_config(_checkpoint_config(entry), entry.cfg):
        shutil.rmtree(entry.checkpoints)
    entry.checkpoints.mkdir(parents=True, exist_ok=True)
    (entry.checkpoints / CONFIG_FILE).write_text(json.dumps(wanted))


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _results_line(path: Path) -> str:
    """The final figures of a finished run, one line."""
    rows = read_results(path)
    summary = next((r for r in rows if r["type"] == "summary"), {})
    final = summary.get("final") or {}
    parts = []
    for mode, short in (("uncompressed", "off"), ("compressed", "on")):
        metrics = final.get(mode) or {}
        if "accuracy" in metrics and "perplexity" not in metrics:
            parts.append(f"final acc {short} {100 * metrics['accuracy']:.2f}%")
        elif "loss" in metrics:
            parts.append(f"final loss {short} {metrics['loss']:.3f}")
    per_sample = sum((summary.get("bytes_per_sample") or {}).values())
    return ", ".join(parts + [f"{per_sample / 1024:.1f} KB/sample"])


class _Heartbeat:
    """Every `every` seconds, one line on `out` with a running run's step, epoch and loss (for logs,
    where a progress bar is unreadable)."""

    def __init__(self, entry: Entry, every: float, out) -> None:
        self.entry, self.every, self.out = entry, every, out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        if self.every > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.every):
            line = _last_step(self.entry.results)
            if line is not None:
                cfg = self.entry.cfg
                cap = f"/{cfg.train.max_steps}" if cfg.train.max_steps else ""
                print(
                    f"    {self.entry.name}: step {line['step']}{cap}, epoch {line['epoch']:.2f}/{cfg.train.epochs:g}, "
                    f"loss {line['loss']:.4f}, {_fmt_time(time.monotonic() - started)} in this session",
                    file=self.out,
                    flush=True,
                )


def _last_step(path: Path) -> dict | None:
    try:
        with path.open() as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("type") == "step":
            return row
    return None


class StudyLocked(RuntimeError):
    """Another study process holds the results directory."""


def _lock(results_dir: Path):
    results_dir.mkdir(parents=True, exist_ok=True)
    handle = (results_dir / ".study.lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise StudyLocked(
            f"{results_dir} is in use by a running study (pid {holder}); wait for it or stop it"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def format_status(entries: list[Entry]) -> list[str]:
    """A table of every run's state, and the time the finished ones took."""
    lines = []
    counts: dict[str, int] = {}
    spent = 0.0
    pace: dict[str, list[float]] = {}  # model -> wall times of its finished runs
    left: dict[str, int] = {}  # model -> runs not finished
    for entry in entries:
        st = status(entry)
        counts[st.state] = counts.get(st.state, 0) + 1
        spent += st.wall_time_s or 0.0
        if entry.cfg is not None:
            model = entry.cfg.model.name
            if st.state == "finished" and st.wall_time_s:
                pace.setdefault(model, []).append(st.wall_time_s)
            elif st.state != "finished":
                left[model] = left.get(model, 0) + 1
        detail = f"{st.steps} steps" + (f", {_fmt_time(st.wall_time_s)}" if st.wall_time_s is not None else "")
        if st.state == "finished":
            detail += f"; {_results_line(entry.results)}"
        if st.note:
            detail += f"; {st.note}"
        lines.append(f"{st.state:9s} {entry.name:34s} {detail}")
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    line = f"{len(entries)} runs: {summary}; finished runs took {_fmt_time(spent)}"
    known = sum(n * sum(pace[m]) / len(pace[m]) for m, n in left.items() if m in pace)
    unknown = sum(n for m, n in left.items() if m not in pace)
    if left:
        line += f"; about {_fmt_time(known)} to go at their pace" + (
            f", plus {unknown} run(s) of a model not timed yet" if unknown else ""
        )
    lines.append(line)
    return lines


def run_study(
    config_dir: str | Path,
    results_dir: str | Path,
    only: list[str] | None = None,
    heartbeat: float = 60.0,
    progress: bool | None = None,
    out=None,
) -> int:
    """Run every unfinished config in order; returns the number of runs that failed.

    `progress` shows tqdm bars (default: when stderr is a terminal); `heartbeat` prints a status
    line every so many seconds otherwise. Runs are never capped: a summary row means finished.
    """
    # Imported here, not at the top: `study --status` and `report` import this module and never
    # train, so they need not load the models, datasets and engine that running an experiment does.
    from swarm.training.experiment import run_experiment

    out = out or sys.stdout
    results_dir = Path(results_dir)
    progress = sys.stderr.isatty() if progress is None else progress
    entries = discover(config_dir, results_dir, only)
    if not entries:
        raise ValueError(f"no configs in {config_dir}" + (f" match {only}" if only else ""))
    lock = _lock(results_dir)
    failed = 0
    try:
        todo = [e for e in entries if status(e).state != "finished"]
        print(
            f"study {config_dir}: {len(entries)} runs, {len(entries) - len(todo)} finished, {len(todo)} to run; results in {results_dir}",
            file=out,
            flush=True,
        )
        for number, entry in enumerate(todo, 1):
            st = status(entry)
            head = f"[{number}/{len(todo)}] {entry.name}"
            if st.state == "invalid":
                print(f"{head}: skipped, the config does not load: {st.note}", file=out, flush=True)
                failed += 1
                continue
            _prepare_checkpoints(entry)
            how = {
                "partial": f"resuming ({st.note}, {st.steps} steps logged)",
                "stale": "config changed, starting over",
            }.get(st.state, "starting")
            print(f"{head}: {how}", file=out, flush=True)
            started = time.monotonic()
            try:
                with _Heartbeat(entry, 0 if progress else heartbeat, out):
                    run_experiment(
                        entry.cfg, entry.results, progress=progress, checkpoint=Checkpointing(str(entry.checkpoints))
                    )
            except KeyboardInterrupt:
                print(f"{head}: interrupted; run the same command again to resume", file=out, flush=True)
                raise
            except Exception as e:  # one bad run must not stop the night's study
                failed += 1
                print(
                    f"{head}: FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); its checkpoints are kept",
                    file=out,
                    flush=True,
                )
                traceback.print_exc(file=sys.stderr)
                continue
            shutil.rmtree(entry.checkpoints, ignore_errors=True)
            print(
                f"{head}: done in {_fmt_time(time.monotonic() - started)}; {_results_line(entry.results)}",
                file=out,
                flush=True,
            )
        done = sum(status(e).state == "finished" for e in entries)
        print(
            f"study {config_dir}: {done}/{len(entries)} runs finished" + (f", {failed} failed" if failed else ""),
            file=out,
            flush=True,
        )
    finally:
        lock.close()
    return failed
