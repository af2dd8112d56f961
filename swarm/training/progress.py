"""Where a run is, from its results rows: step, loss, samples per second, time left.

Fed every row the run writes (`ResultsWriter.listeners`), read by what shows progress: the
trainer's plain progress lines, its progress record on the DHT (the health page) and its metrics.
Rates are over the last `window` steps, so a pause or a slow start fades out of them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class RunProgress:
    def __init__(self, total_steps: int | None = None, window: int = 20) -> None:
        self.total_steps = total_steps
        self.step = 0
        self.samples = 0
        self.loss: float | None = None
        self.lr: float | None = None
        self.time_s = 0.0  # the run's seconds at the last step
        self.evaluation: dict[str, float] = {}  # the last evaluation's metrics (uncompressed)
        self._points: deque[tuple[int, int, float]] = deque(maxlen=window + 1)  # (step, samples, time_s)
        self._lock = threading.Lock()  # rows come on the training thread, reads from anywhere

    def observe(self, row: dict) -> None:
        kind = row.get("type")
        with self._lock:
            if kind == "step":
                if self._points and row["step"] <= self._points[-1][0]:
                    self._points.clear()  # a step again: the run went back (or resumed)
                self.step, self.samples = int(row["step"]), int(row["samples"])
                self.loss, self.lr = float(row["loss"]), float(row["lr"])
                self.time_s = float(row["time_s"])
                self._points.append((self.step, self.samples, self.time_s))
            elif kind == "eval":
                self.evaluation = dict(row.get("uncompressed", {}))
            elif kind == "rewind":
                self.step = int(row["step"])
                self._points.clear()

    def _span(self) -> tuple[int, int, float] | None:
        """(steps, samples, seconds) over the window; None before two steps."""
        if len(self._points) < 2:
            return None
        (s0, n0, t0), (s1, n1, t1) = self._points[0], self._points[-1]
        return (s1 - s0, n1 - n0, t1 - t0) if t1 > t0 else None

    @property
    def samples_per_s(self) -> float:
        with self._lock:
            span = self._span()
        return span[1] / span[2] if span else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds to the last step at the window's pace; None when not known."""
        with self._lock:
            span, step = self._span(), self.step
        if span is None or self.total_steps is None or span[0] <= 0:
            return None
        return max(0, self.total_steps - step) * span[2] / span[0]

    def snapshot(self) -> dict:
        """Everything at once, from one row (another thread may be adding the next)."""
        with self._lock:
            now = {
                "step": self.step,
                "total_steps": self.total_steps,
                "samples": self.samples,
                "loss": self.loss,
                "lr": self.lr,
                "evaluation": dict(self.evaluation),
            }
        return {**now, "samples_per_s": self.samples_per_s, "eta_s": self.eta_s}

    def line(self) -> str:
        """One plain progress line (for logs: no terminal to draw a bar on)."""
        total = f"/{self.total_steps}" if self.total_steps else ""
        loss = f" loss {self.loss:.6f}" if self.loss is not None else ""
        lr = f" lr {self.lr:.5f}" if self.lr is not None else ""
        rate = f", {self.samples_per_s:.1f} samples/s" if self.samples_per_s else ""
        eta = self.eta_s
        left = f", {format_duration(eta)} left" if eta is not None else ""
        return f"step {self.step}{total}:{loss}{lr}{rate}{left} ({self.time_s:.1f}s)"


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def sample_line(row: dict) -> str:
    """How a sample row (train.sample_every) prints beside the loss."""
    return f"sample at step {row['step']}: {row['prompt']!r} -> {row['text']!r}"


def echo_lines(progress: RunProgress, say) -> Callable[[dict], None]:
    """A results listener that `say`s one line per step, evaluation and sample, where no terminal
    shows a bar (logs, `swarm lab`'s prefixed lines); `progress` must have seen the row already."""

    def echo(row: dict) -> None:
        if row.get("type") == "step":
            say(progress.line())
        elif row.get("type") == "eval":
            say(
                f"eval at step {row['step']}: "
                + "; ".join(
                    f"{mode} " + ", ".join(f"{k} {v:.4f}" for k, v in row[mode].items())
                    for mode in ("uncompressed", "compressed")
                    if mode in row
                )
            )
        elif row.get("type") == "sample":
            say(sample_line(row))

    return echo
