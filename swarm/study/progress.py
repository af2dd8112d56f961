"""A study's progress: runs done and left, the time left, the `--status` table and heartbeat lines.

Time left is estimated from measured durations: an unfinished run takes what the finished runs of
the same row (other seeds) took on average, else those of the same model; a run already under
way needs only its share still to do (by epoch, or by step when the config caps the steps). Runs
with nothing finished to go by are counted apart ("not timed yet"). Durations are computing time:
a run's pauses are left out (swarm.study.pace), or a study paused for an hour would count an hour
more for every later run of the paused run's row.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.study.entries import Entry, Status, status
from swarm.study.pace import computing_seconds
from swarm.training.results import read_results


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def done_share(entry: Entry, steps: int, epoch: float) -> float:
    """How much of a run is behind it (0-1), from its last logged step."""
    train = entry.cfg.train
    share = epoch / train.epochs if train.epochs else 0.0
    if train.max_steps:
        share = max(share, steps / train.max_steps)
    return min(share, 1.0)


@dataclass
class Estimate:
    done: int  # runs finished
    left: int  # runs not finished
    seconds: float  # time left of the runs that could be timed
    untimed: int  # runs left with no finished run of their row or model to go by

    def line(self) -> str:
        text = f"{self.done} done / {self.left} left"
        if self.left:
            text += f", about {fmt_time(self.seconds)} left"
            if self.untimed:
                text += f" plus {self.untimed} run(s) not timed yet"
        return text


def estimate(entries: list[Entry], states: dict[str, Status] | None = None) -> Estimate:
    """Runs done and left, and the time left at the pace of the finished ones (see the module)."""
    states = states or {e.name: status(e) for e in entries}
    by_row: dict[str, list[float]] = {}
    by_model: dict[str, list[float]] = {}
    for entry in entries:
        st = states[entry.name]
        if st.state == "finished" and st.computing_s and entry.cfg is not None:
            by_row.setdefault(entry.row, []).append(st.computing_s)
            by_model.setdefault(entry.cfg.model.name, []).append(st.computing_s)
    done = seconds = untimed = 0
    for entry in entries:
        st = states[entry.name]
        if st.state == "finished":
            done += 1
            continue
        paces = by_row.get(entry.row) or (by_model.get(entry.cfg.model.name) if entry.cfg is not None else None)
        if not paces:
            untimed += 1
            continue
        share = done_share(entry, st.steps, st.epoch) if st.state == "partial" else 0.0
        seconds += (1.0 - share) * sum(paces) / len(paces)
    return Estimate(done, len(entries) - done, seconds, untimed)


def results_line(path: Path) -> str:
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


def format_status(entries: list[Entry]) -> list[str]:
    """A table of every run's state, and the runs and time left."""
    lines = []
    counts: dict[str, int] = {}
    spent = 0.0
    states = {e.name: status(e) for e in entries}
    for entry in entries:
        st = states[entry.name]
        counts[st.state] = counts.get(st.state, 0) + 1
        spent += st.computing_s or 0.0
        detail = f"{st.steps} steps" + (f", {fmt_time(st.computing_s)}" if st.computing_s is not None else "")
        if st.wall_time_s is not None and st.computing_s is not None and st.wall_time_s > st.computing_s + 60:
            detail += f" ({fmt_time(st.wall_time_s)} with its pauses)"
        if st.state == "finished":
            detail += f"; {results_line(entry.results)}"
        if st.note:
            detail += f"; {st.note}"
        lines.append(f"{st.state:9s} {entry.name:40s} {detail}")
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    lines.append(
        f"{len(entries)} runs: {summary}; finished runs took {fmt_time(spent)}; {estimate(entries, states).line()}"
    )
    return lines


def logged_rows(path: Path) -> list[dict]:
    """The rows of a results file being written: a line cut short at its end is left out."""
    try:
        with path.open() as f:
            lines = f.readlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def heartbeat_line(entry: Entry, rows: list[dict], session_s: float, others: Estimate) -> str:
    """A running run's step, epoch and loss (its last step row of `rows`), and the study's runs and
    time left: the other runs at their estimate, this one at its own measured pace (its computing
    seconds per share done so far)."""
    step = next(r for r in reversed(rows) if r.get("type") == "step")
    cfg = entry.cfg
    cap = f"/{cfg.train.max_steps}" if cfg.train.max_steps else ""
    share = done_share(entry, step["step"], step["epoch"])
    spent = computing_seconds(rows)
    mine = spent * (1.0 - share) / share if share > 0 and spent is not None else None
    left = Estimate(others.done, others.left + 1, others.seconds + (mine or 0.0), others.untimed + (mine is None))
    return (
        f"    {entry.name}: step {step['step']}{cap}, epoch {step['epoch']:.2f}/{cfg.train.epochs:g}, "
        f"loss {step['loss']:.4f}, {fmt_time(session_s)} in this session; study: {left.line()}"
    )


class Heartbeat:
    """Every `every` seconds, one line on `out` with a running run's step, epoch and loss, and the
    study's progress (for logs, where a progress bar is unreadable). `others`: the estimate of the
    study's other runs, made when this one started."""

    def __init__(self, entry: Entry, every: float, out, others: Estimate) -> None:
        self.entry, self.every, self.out, self.others = entry, every, out, others
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
            rows = logged_rows(self.entry.results)
            if any(r.get("type") == "step" for r in rows):
                line = heartbeat_line(self.entry, rows, time.monotonic() - started, self.others)
                print(line, file=self.out, flush=True)
