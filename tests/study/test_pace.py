"""A run's computing time: its results rows' time less the pauses (a suspended study), which the
study's time left and the report's total go by."""

from __future__ import annotations

import pytest

from swarm.study.pace import computing_seconds


def steps(times: list[float]) -> list[dict]:
    return [{"type": "step", "step": i + 1, "time_s": t} for i, t in enumerate(times)]


def test_a_run_without_pauses_takes_its_wall_time():
    rows = [{"type": "config"}, *steps([2.0, 3.0, 4.0, 5.0]), {"type": "summary", "wall_time_s": 5.5}]
    assert computing_seconds(rows) == pytest.approx(5.5)


def test_a_pause_between_steps_counts_as_one_usual_step():
    rows = steps([1.0, 2.0, 3.0, 3003.0, 3004.0]) + [{"type": "summary", "wall_time_s": 3004.2}]
    assert computing_seconds(rows) == pytest.approx(5.2)  # the 3,000 s gap counts 1 s, as the others


def test_a_pause_in_an_evaluation_counts_as_the_run_s_quickest_evaluation():
    rows = steps([1.0, 2.0]) + [{"type": "eval", "step": 2, "time_s": 12.0, "eval_s": 10.0}]
    rows += steps([13.0, 14.0]) + [{"type": "eval", "step": 4, "time_s": 2024.0, "eval_s": 2010.0}]
    rows += [{"type": "eval", "step": 4, "time_s": 2036.0, "eval_s": 12.0}]  # slower, not paused
    assert computing_seconds(rows) == pytest.approx(4 * 1.0 + 10.0 + 10.0 + 12.0)


def test_slow_steps_are_not_pauses_and_evaluations_do_not_set_the_usual_step():
    slow = steps([1.0, 2.0, 3.0, 50.0, 51.0])  # 47x the usual step: contention, counted in full
    assert computing_seconds(slow) == pytest.approx(51.0)
    # an evaluation after every step: its 0.1 s gaps (besides its own 1 s) leave the usual step at
    # about 1 s, so the 61 s step (a slow one, not a pause: 64x) counts in full
    rows = []
    for t in (1.0, 3.0, 5.0, 67.0):
        rows += [{"type": "step", "time_s": t}, {"type": "eval", "time_s": t + 1.1, "eval_s": 1.0}]
    assert computing_seconds(rows) == pytest.approx(68.1)


def test_rows_without_time_have_the_summarys_wall_time_or_none():
    assert computing_seconds([{"type": "config"}, {"type": "step", "step": 1}]) is None
    assert computing_seconds([{"type": "step", "step": 1}, {"type": "summary", "wall_time_s": 9.0}]) == 9.0
