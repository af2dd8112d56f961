"""A lab run's training seconds and its first evaluation at a target (bench time-to-target's lab
runs, swarm.bench.step_time and swarm.bench.target_estimate).

Evaluations are uncompressed and the same for every codec; their time is left out of the training
seconds (each eval row carries its own `eval_s`), so a run is not charged for how often the config
evaluates.
"""

from __future__ import annotations

from swarm.config.target import Target


def training_seconds(rows: list[dict]) -> list[dict]:
    """The rows with each step's and evaluation's `time_s` made training seconds: the evaluations
    before it (their `eval_s`) taken out."""
    spent, out = 0.0, []
    for row in rows:
        if row.get("type") in ("step", "eval") and "time_s" in row:
            own = row.get("eval_s", 0.0) if row["type"] == "eval" else 0.0
            row = {**row, "time_s": row["time_s"] - spent - own}
            spent += own
        out.append(row)
    return out


def reaching(rows: list[dict], target: Target) -> tuple[list[list[float]], dict | None]:
    """([training seconds, step, metric] of every evaluation, the first evaluation that reached the target)."""
    return _reaching(training_seconds(rows), target)


def _reaching(trained: list[dict], target: Target) -> tuple[list[list[float]], dict | None]:
    curve, first = [], None
    for row in trained:
        if row.get("type") != "eval":
            continue
        metrics = row.get("uncompressed", {})
        target.require_reported(metrics)
        curve.append([row["time_s"], row["step"], metrics[target.metric]])
        if first is None and target.reached(metrics):
            first = row
    return curve, first
