"""`python -m swarm study CONFIG_DIR [--seeds N]`: run every config of a study that has not
finished, at N seeds, resumably.

Each config `NAME.yaml` writes `RESULTS_DIR/NAME.jsonl` (seed k > 0: `NAME.seed<S>.jsonl`, see
swarm.study.entries) and checkpoints into `RESULTS_DIR/checkpoints/NAME/`. The runs go in the order
of swarm.study.order: every seed of the rows the findings compare first, round-robin over seeds;
rows no finding compares run once. A run is finished when its results file ends in a summary row
written for the config as it is now; a run with a checkpoint resumes from it (exactly, see
`swarm.training.loop.train`); anything else starts from scratch. Checkpoints of a finished run are deleted.
Stop the study at any time (Ctrl-C, kill, a reboot) and start it again: it picks up where it was,
losing at most the steps since the last evaluation. One study process per results directory (a
lock file refuses a second one).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from swarm.study.entries import CONFIG_FILE, Entry, checkpoint_config, config_json, discover, same_config, status
from swarm.study.order import plan
from swarm.study.progress import Heartbeat, estimate, fmt_time, results_line
from swarm.training.checkpoints import Checkpointing


def _prepare_checkpoints(entry: Entry) -> None:
    """Checkpoints written for another version of the config are dropped; the current one is recorded."""
    wanted = config_json(entry.cfg)
    if entry.checkpoints.exists() and not same_config(checkpoint_config(entry), entry.cfg):
        shutil.rmtree(entry.checkpoints)
    entry.checkpoints.mkdir(parents=True, exist_ok=True)
    (entry.checkpoints / CONFIG_FILE).write_text(json.dumps(wanted))


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


@dataclass(frozen=True)
class StudyOutput:
    """How a study tells its progress: `out` (default stdout) takes its lines; `progress` shows tqdm
    bars (default: when stderr is a terminal); `heartbeat` prints a status line every so many
    seconds otherwise."""

    heartbeat: float = 60.0
    progress: bool | None = None
    out: TextIO | None = None


def run_study(
    config_dir: str | Path,
    results_dir: str | Path,
    only: list[str] | None = None,
    seeds: int = 1,
    every_row: bool = False,
    output: StudyOutput = StudyOutput(),
) -> int:
    """Run every unfinished run of the study's plan in order; returns the number of runs that failed.

    Runs are never capped: a summary row means finished.
    """
    # Imported here, not at the top: `study --status` and `report` import this module and never
    # train, so they need not load the models, datasets and engine that running an experiment does.
    from swarm.training.experiment import run_experiment

    out, heartbeat = output.out or sys.stdout, output.heartbeat
    results_dir = Path(results_dir)
    progress = sys.stderr.isatty() if output.progress is None else output.progress
    entries = plan(discover(config_dir, results_dir, only, seeds), every_row)
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
            others = estimate([e for e in entries if e is not entry])
            print(f"{head}: study {others.line()} besides this run", file=out, flush=True)
            try:
                with Heartbeat(entry, 0 if progress else heartbeat, out, others):
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
                f"{head}: done in {fmt_time(time.monotonic() - started)}; {results_line(entry.results)}",
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
