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


def test_slow_steps_and_a_resumed_run_going_back_in_time_are_not_pauses():
    slow = steps([1.0, 2.0, 3.0, 50.0, 51.0])  # 47x the usual step: contention, counted in full
    assert computing_seconds(slow) == pytest.approx(51.0)
    resumed = steps([1.0, 2.0, 3.0, 4.0]) + steps([2.5, 3.5, 4.5])  # from a checkpoint at 2.5 s
    assert computing_seconds(resumed) == pytest.approx(4.0 + 1.0 + 1.0)


def test_rows_without_time_have_no_computing_time():
    assert computing_seconds([{"type": "config"}, {"type": "step", "step": 1}]) is None
