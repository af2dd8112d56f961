"""`train.sample_every`: a language model's sample through the pipeline at an evaluation, which
changes no training state (the swarm's: tests/export/test_export_swarm.py)."""

from __future__ import annotations

import math

import pytest
import torch
from _export_cases import tiny_llama

from swarm.models.base import Targets, causal_lm_metrics
from swarm.models.sampling import pick, sample_request, tokens_of
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.progress import RunProgress, echo_lines
from swarm.training.results import ResultsWriter
from swarm.training.sampling import PipelineSampler
from swarm.transport.local import build_local_pipeline


def _timeless(rows) -> list[dict]:
    """The step and evaluation rows without their clock readings."""
    return [
        {k: v for k, v in r.items() if k not in ("time_s", "at", "eval_s")}
        for r in rows
        if r["type"] in ("step", "eval")
    ]


def _run(cfg, steps: int = 4):
    """Rows, every stage's state and optimizer state, and the global RNG after the run."""
    data = build_data(cfg)
    pipeline, staged = build_local_pipeline(cfg, Schedule.of(cfg, len(data[0]), steps).lr_horizon, len(data[0]))
    results = ResultsWriter(None)
    train(cfg, pipeline, data, results, steps, progress=False)
    states = [(r.module.state_dict(), r.optimizer.state_dict()["state"]) for r in pipeline.runtimes]
    return results.rows, states, torch.get_rng_state()


def test_samples_leave_losses_evaluations_weights_and_generators_as_a_run_without_them(tmp_path):
    plain_rows, plain_states, plain_rng = _run(tiny_llama(tmp_path, pretrained=False))
    cfg = tiny_llama(
        tmp_path, "train.sample_every=1", "train.sample_tokens=3", "train.sample_temperature=1", pretrained=False
    )
    rows, states, rng = _run(cfg)
    assert _timeless(rows) == _timeless(plain_rows)  # the same losses, learning rates, bytes, evaluations, exactly
    for (module, optimizer), (plain_module, plain_optimizer) in zip(states, plain_states, strict=True):
        assert all(torch.equal(module[k], plain_module[k]) for k in module)
        assert all(torch.equal(optimizer[i]["exp_avg"], plain_optimizer[i]["exp_avg"]) for i in optimizer)
    assert torch.equal(rng, plain_rng)
    samples = [r for r in rows if r["type"] == "sample"]
    assert [r["step"] for r in samples] == [r["step"] for r in rows if r["type"] == "eval"] == [2, 4]
    assert all(len(r["tokens"]) == 3 and r["temperature"] == 1 and r["prompt"] == "the cat 1" for r in samples)
    said: list[str] = []
    echo = echo_lines(RunProgress(), said.append)
    echo(samples[0])
    assert said == [f"sample at step 2: 'the cat 1' -> {samples[0]['text']!r}"]


def test_the_last_stage_picks_the_greedy_or_the_drawn_token():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.7]))
    assert pick(logits, 0.0, 0.01) == 2  # greedy: whatever the draw
    assert [pick(logits, 1.0, draw) for draw in (0.05, 0.25, 0.95)] == [0, 1, 2]  # the cumulative 0.1, 0.3, 1.0
    flat = pick(logits, 1e6, 0.5)  # a very high temperature: nearly uniform, the middle one
    assert flat == 1
    rows = torch.stack([torch.zeros(4, 3), logits.expand(4, 3)])  # [rows 2, T 4, vocab 3]
    request = sample_request(0.0, torch.tensor([0.9, 0.9]))
    assert tokens_of(causal_lm_metrics(rows, request)) == [0, 2]  # argmax of each row's last position
    labels = torch.zeros(2, 4, dtype=torch.long)
    assert "loss_sum" in causal_lm_metrics(rows, labels)  # labels still give the sums
    assert math.isclose(float(sample_request(0.5, torch.tensor([0.25]))[0, 0]), 0.5)


def test_a_sample_needs_data_with_a_tokenizer(tmp_path):
    cfg = tiny_llama(tmp_path, "train.sample_every=1", pretrained=False)
    data = build_data(cfg)
    assert PipelineSampler.of(cfg, data).prompt  # the start of the test split's first block
    custom = cfg.model_copy(update={"data": cfg.data.model_copy(update={"name": "tests:none", "options": {}})})
    with pytest.raises(ValueError, match=r"train.sample_every: data tests:none names no tokenizer"):
        PipelineSampler.of(custom, data)


def test_a_stage_takes_a_sample_request_only_from_an_evaluation_micro_batch():
    """Where a stage peer decodes a micro-batch (swarm.models.base.Targets): a language model's
    evaluation may ask for a sample; anything else with those targets is its sender's fault."""
    tokens = Targets(50, dims=1, ignore=-100, samples=True)
    request = sample_request(0.7, torch.tensor([0.3]))
    assert tokens.problem(request, evaluating=True) is None
    assert tokens.problem(request) == "a sample request (1, 2) in a training micro-batch"
    assert tokens.problem(sample_request(0.7, torch.tensor([1.5])), evaluating=True) == (
        "a sample request's draws must be in [0, 1]"
    )
    assert tokens.problem(sample_request(-1, torch.tensor([0.5])), evaluating=True).endswith("finite numbers >= 0")
    assert Targets(10, probabilities=True).problem(request, evaluating=True).startswith("float64 values")
