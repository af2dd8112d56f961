"""A run's computing time: the time its results rows log, less the pauses in it.

A row's `time_s` is the wall clock since the run began (a resumed run goes on from its checkpoint's
time), so a run that was suspended (SIGSTOP, a laptop's lid, a machine paused for other work)
logs its pause as time spent training. The study's time left and the report's total go by the
computing time instead, or one pause of an hour makes every run of its row look an hour longer.

A gap between two rows far longer than the run's usual one (PAUSE_FACTOR x the median gap between
step rows) is taken for a pause and counted as one usual gap. Evaluations log their own duration
(`eval_s`); every evaluation of a run scores the same test set, so one that took far longer than
the run's quickest (EVAL_PAUSE_FACTOR x) was paused, and counts as the quickest.
"""

from __future__ import annotations

import statistics

# A step 100x the run's median is no step: in the study's runs, gaps with an evaluation's time taken
# out were at most about 45x the median, and the pauses that misled its estimates 300x-6,000x.
PAUSE_FACTOR = 100
# Evaluations of one run varied up to about 10x in the study (test runs beside it); paused ones
# took 60x-450x the run's quickest.
EVAL_PAUSE_FACTOR = 20


def _timed(rows: list[dict]) -> list[tuple[float, float]]:
    """(time_s, eval_s) of each step and evaluation row, in the file's order."""
    timed = []
    for row in rows:
        t = row.get("time_s")
        if row.get("type") in ("step", "eval") and isinstance(t, (int, float)):
            spent = row.get("eval_s") if row["type"] == "eval" else 0.0
            timed.append((float(t), float(spent) if isinstance(spent, (int, float)) else 0.0))
    return timed


def computing_seconds(rows: list[dict]) -> float | None:
    """The time a run's rows log, pauses counted as one usual gap (a finished run's summary adds
    its last stretch, after the last row); without timed rows, the summary's wall time, else None."""
    summary = next((r for r in rows if r.get("type") == "summary"), None)
    wall = summary.get("wall_time_s") if summary else None
    wall = wall if isinstance(wall, (int, float)) else None
    timed = _timed(rows)
    if not timed:
        return wall
    gaps, before = [], 0.0
    for t, spent in timed:
        gaps.append((max(t - before - spent, 0.0), spent))  # never negative, whatever a file holds
        before = t
    steps = [g for g, spent in gaps if not spent and g > 0]  # an evaluation's gap is not a step's
    usual = statistics.median(steps or [0.0])
    quickest = min((spent for _, spent in gaps if spent > 0), default=0.0)
    total = sum(
        (usual if g > PAUSE_FACTOR * usual else g) + (quickest if spent > EVAL_PAUSE_FACTOR * quickest else spent)
        for g, spent in gaps
    )
    if wall is not None:
        tail = wall - before
        total += usual if tail > PAUSE_FACTOR * usual else max(tail, 0.0)
    return total
