"""train.target: METRIC=VALUE, its direction, and where a run stops."""

from __future__ import annotations

import math

import pytest

from swarm.config import ConfigError, load_config
from swarm.config.target import Target
from swarm.training.experiment import run_experiment
from swarm.training.results import read_results


def test_loss_and_perplexity_are_better_lower_the_rest_higher():
    assert Target.parse("loss=2.0") == Target("loss", 2.0, True)
    assert Target.parse("perplexity = 9") == Target("perplexity", 9.0, True)
    assert Target.parse("accuracy=0.9") == Target("accuracy", 0.9, False)
    assert Target.parse("accuracy<=0.1").lower_is_better and not Target.parse("loss>=3").lower_is_better
    goal = Target.parse("loss=2")
    assert goal.reached({"loss": 1.99}) and goal.reached({"loss": 2.0}) and not goal.reached({"loss": 2.01})
    assert not goal.reached({"accuracy": 1.0}) and not goal.reached({"loss": math.nan})
    assert Target.parse("accuracy=0.5").reached({"accuracy": 0.6}) and str(goal) == "loss<=2"


@pytest.mark.parametrize("text", ["loss", "loss=", "=2", "loss=two", "loss=nan", "loss=inf", "2=loss", "loss==2"])
def test_a_bad_target_is_one_line(text):
    with pytest.raises(ValueError, match="target") as info:
        Target.parse(text)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="train.target"):
        load_config("configs/smoke.yaml", [f"train.target={text}"])


def test_a_run_stops_at_the_first_evaluation_that_reaches_its_target(tmp_path):
    # every evaluation reaches accuracy >= 0: the run stops at the first one (step 2 of 10)
    sets = ["train.eval_every=0.2", "train.eval_compressed=false", "model.num_stages=2"]
    reached = run_experiment(
        load_config("configs/smoke.yaml", [*sets, "train.target=accuracy=0"]), tmp_path / "a.jsonl", 10, False
    )
    assert reached["reached"] is True and reached["target"] == "accuracy>=0" and reached["steps"] == 2
    never = run_experiment(
        load_config("configs/smoke.yaml", [*sets, "train.target=loss=0.001"]), tmp_path / "b.jsonl", 10, False
    )
    assert never["reached"] is False and never["steps"] == 10
    rows = read_results(tmp_path / "b.jsonl")
    evals = [r for r in rows if r["type"] == "eval"]
    steps = {r["step"]: r for r in rows if r["type"] == "step"}
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10]
    for e in evals:  # each evaluation says when it ended and how long it took
        assert 0 < e["eval_s"] <= e["time_s"] - steps[e["step"]]["time_s"] + 1e-6


def test_a_target_no_evaluation_reports_stops_the_run_at_the_first_evaluation(tmp_path):
    with pytest.raises(ValueError, match="^train.target foo>=1: the evaluations report accuracy, loss, not foo$"):
        Target.parse("foo=1").require_reported({"loss": 1.0, "accuracy": 0.5})
    Target.parse("loss=1").require_reported({"loss": math.nan})  # reported, though not a number: not refused
    sets = ["train.eval_every=0.2", "train.eval_compressed=false", "model.num_stages=2", "train.target=foo=1"]
    with pytest.raises(ValueError, match="the evaluations report accuracy, loss, not foo"):
        run_experiment(load_config("configs/smoke.yaml", sets), tmp_path / "a.jsonl", 10, False)
    rows = read_results(tmp_path / "a.jsonl")  # what ran before the refusal is kept
    assert [r["step"] for r in rows if r["type"] == "step"] == [1, 2]
    assert [r["step"] for r in rows if r["type"] == "eval"] == [2]
