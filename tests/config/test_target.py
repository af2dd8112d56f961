"""train.target: METRIC=VALUE, its direction, and where a run stops."""

from __future__ import annotations

import math

import pytest
from torch.utils.data import Subset

from swarm.config import ConfigError, load_config
from swarm.config.target import METRICS, Target
from swarm.models.base import summarize
from swarm.training import experiment
from swarm.training.checkpoints import Checkpointing, latest_run, run_step
from swarm.training.experiment import build_data, run_experiment
from swarm.training.results import read_results

SMOKE = "configs/smoke.yaml"


def test_loss_and_perplexity_are_better_lower_the_rest_higher():
    assert Target.parse("loss=2.0") == Target("loss", 2.0, True)
    assert Target.parse("perplexity = 9") == Target("perplexity", 9.0, True)
    assert Target.parse("accuracy=0.9") == Target("accuracy", 0.9, False)
    assert Target.parse("accuracy<=0.1").lower_is_better and not Target.parse("loss>=3").lower_is_better
    goal = Target.parse("loss=2")
    assert goal.reached({"loss": 1.99}) and goal.reached({"loss": 2.0}) and not goal.reached({"loss": 2.01})
    assert not goal.reached({"accuracy": 1.0}) and not goal.reached({"loss": math.nan})
    assert Target.parse("accuracy=0.5").reached({"accuracy": 0.6}) and str(goal) == "loss<=2"
    # the metrics a target may name are every one an evaluation can report
    assert set(METRICS) == set(summarize({"count": 2.0, "loss_sum": 1.0, "correct": 1.0}, perplexity=True))


@pytest.mark.parametrize(
    "text", ["loss", "loss=", "=2", "loss=two", "loss=nan", "loss=inf", "2=loss", "loss==2", "acc=0.9", "val_loss=2"]
)
def test_a_bad_target_is_one_line(text):
    with pytest.raises(ValueError, match="target") as info:
        Target.parse(text)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="train.target"):
        load_config(SMOKE, [f"train.target={text}"])


def test_a_run_stops_at_the_first_evaluation_that_reaches_its_target(tmp_path):
    # every evaluation reaches accuracy >= 0: the run stops at the first one (step 2 of 10)
    sets = ["train.eval_every=0.2", "train.eval_compressed=false", "model.num_stages=2"]
    reached = run_experiment(load_config(SMOKE, [*sets, "train.target=accuracy=0"]), tmp_path / "a.jsonl", 10, False)
    assert reached["reached"] is True and reached["target"] == "accuracy>=0" and reached["steps"] == 2
    never = run_experiment(load_config(SMOKE, [*sets, "train.target=loss=0.001"]), tmp_path / "b.jsonl", 10, False)
    assert never["reached"] is False and never["steps"] == 10
    rows = read_results(tmp_path / "b.jsonl")
    evals = [r for r in rows if r["type"] == "eval"]
    steps = {r["step"]: r for r in rows if r["type"] == "step"}
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10]
    for e in evals:  # each evaluation says when it ended and how long it took
        assert 0 < e["eval_s"] <= e["time_s"] - steps[e["step"]]["time_s"] + 1e-6


def test_a_target_no_evaluation_reports_stops_the_run_at_its_first_evaluation_and_nothing_is_lost(tmp_path):
    with pytest.raises(
        ValueError, match="^train.target perplexity<=1: the evaluations report accuracy, loss, not perplexity$"
    ):
        Target.parse("perplexity=1").require_reported({"loss": 1.0, "accuracy": 0.5})
    Target.parse("loss=1").require_reported({"loss": math.nan})  # reported, though not a number: not refused
    with pytest.raises(ValueError, match="^train.target accuracy>=0.5: the evaluations report no metrics .*counted"):
        Target.parse("accuracy=0.5").require_reported(summarize({"loss_sum": 3.0, "correct": 1.0}))  # a count of 0
    sets = ["train.eval_every=0.2", "train.eval_compressed=false", "model.num_stages=2"]
    saved = Checkpointing(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match="the evaluations report accuracy, loss, not perplexity"):  # a classifier's
        run_experiment(load_config(SMOKE, [*sets, "train.target=perplexity=1"]), tmp_path / "a.jsonl", 10, False, saved)
    rows = read_results(tmp_path / "a.jsonl")  # what ran before the refusal is kept, and checkpointed
    assert [r["step"] for r in rows if r["type"] == "step"] == [1, 2]
    assert [r["step"] for r in rows if r["type"] == "eval"] == [2] and run_step(latest_run(saved.directory)) == 2
    # resumed with a target its last evaluation reached: it stops there, with no step more
    resumed = run_experiment(
        load_config(SMOKE, [*sets, "train.target=accuracy=0"]), tmp_path / "a.jsonl", 10, False, saved
    )
    assert resumed["reached"] is True and resumed["steps"] == 2
    assert [r["step"] for r in read_results(tmp_path / "a.jsonl") if r["type"] == "step"] == [1, 2]


def test_a_target_without_test_data_is_refused_before_any_step(tmp_path, monkeypatch):
    def no_test_split(cfg):
        train_set, test_set = build_data(cfg)
        return train_set, Subset(test_set, [])

    monkeypatch.setattr(experiment, "build_data", no_test_split)
    with pytest.raises(
        ValueError, match="^train.target loss<=1: the test split is empty, so no evaluation can reach it$"
    ):
        run_experiment(load_config(SMOKE, ["train.target=loss=1"]), tmp_path / "a.jsonl", 10, False)
    assert not [r for r in read_results(tmp_path / "a.jsonl") if r["type"] == "step"]
