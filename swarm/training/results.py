"""Results as JSON lines: one object per line with a "type" (config, step, eval, summary).

Schema (every line has "type"):
- config:  {"name", "config": {...}, "started": ISO time, "stamp": {"commit", "torch", "threads"}}
           (stamp: swarm.training.stamp; files written before it existed have none)
- step:    {"step", "epoch", "loss", "lr", "samples", "exact", "bytes": {"boundary<i>.<direction>": bytes this step}, "time_s", "at": unix time}
           swarm runs add "stages" (each stage peer's compute so far, as in the stages row) and, with
           adaptive compression, "codecs"
- eval:    {"step", "epoch", "uncompressed": {metrics}, "compressed": {metrics}}  (metrics: loss and
           accuracy; perplexity for language models)
- sample:  (train.sample_every) {"step", "prompt", "text", "tokens": [new token ids], "temperature"}:
           a language model's sample through the pipeline after the evaluation of that step
- summary: {"name", "steps", "samples", "wall_time_s", "bytes": {link totals}, "bytes_per_sample":
           {link: bytes per training sample}, "state_bytes", "final": {eval row}, "best": {"compressed": .., "uncompressed": ..}}
           swarm runs add "round_bytes" (payload bytes of the trainer's step rounds, by
           "<round>.<sent|received>"), "copies" ({"every", "rounds", "seconds", "bytes": {stage: the
           last copy's bytes}}: the swarm's copies of every stage) and "pauses" ([{"from_step",
           "to_step", "paused_s"}]: a stage lost its last peer) and "restarts" ([{"to_step"}]: a new
           trainer took the run over from the swarm's copies)
- meter:   (lab runs) {"every_s", "samples": [{"at": unix time, "links": {process: [bytes sent,
           received]} (in namespaces; else {}), "cpu_busy_s", "cpu_total_s", "cpu": {process: [its
           CPU s, its p2p daemon's]}}]} (swarm.netlab.counters)
- stages:  (swarm runs) {"stages": [{"stage", "compute_s", "compute_cpu_s", "samples", "processed", "throughput"} per stage peer]}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEPPED = ("step", "eval", "sample")  # rows of one step: a run that goes back drops those after it


class ResultsWriter:
    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w")
        self.rows: list[dict[str, Any]] = []
        # called with every row written or kept, and {"type": "rewind", "step"} when the run goes back
        # (progress lines, the trainer's progress record and metrics)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._lines([row])
        self._tell([row])

    def keep(self, rows: list[dict[str, Any]]) -> None:
        """Rows a resumed run keeps from before (written to the file again)."""
        self.rows.extend(rows)
        self._lines(rows)
        self._tell(rows)

    def _tell(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            for listener in self.listeners:
                listener(row)

    def rewind(self, step: int) -> None:
        """The run went back to `step`: its step and eval rows after it go (each step is kept once)."""
        self._tell([{"type": "rewind", "step": step}])
        self.rows = [r for r in self.rows if r.get("type") not in STEPPED or r.get("step", 0) <= step]
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
        self._lines(self.rows)

    def _lines(self, rows: list[dict[str, Any]]) -> None:
        if self._file is not None:
            for row in rows:
                self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_results(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: not a JSON line") from None
            if not isinstance(row, dict) or "type" not in row:
                raise ValueError(f"{path}:{number}: a results line needs a 'type'")
            rows.append(row)
    return rows
