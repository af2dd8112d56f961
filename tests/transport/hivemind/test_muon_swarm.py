"""`optimizer.name: muon` over a swarm on real hivemind (loopback): the stages' Muon and AdamW
steps, with replicas that sum their gradients before the update and with the asynchronous
schedule's look-ahead, give one process's losses."""

from __future__ import annotations

import uuid

from _swarm_env import assert_close_losses, assert_same_run, local_rows, smoke, step_losses, swarm_rows, tiny_gpt2

from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import train
from swarm.training.results import ResultsWriter, read_results

MUON = "optimizer={name: muon, lr: 0.05, adamw_lr: 0.005, weight_decay: 0.0001, grad_clip: 0.5}"


def test_muon_with_a_replicated_stage_gives_one_process_losses(swarm, tmp_path):
    """The digits CNN (its convolutions' kernels step as flattened matrices) with stage 1 on two peers."""
    cfg = smoke(MUON, "compression.forward=quant:4", "compression.backward=quant:6")
    ours = swarm_rows(swarm, cfg, placement=[(0, 0), (1, 1), (1, 4), (2, 2), (3, 3)])
    assert_same_run(ours, local_rows(cfg, tmp_path))


def test_muon_asynchronous_with_look_ahead_and_tied_parameters_gives_one_process_losses(swarm, tmp_path):
    cfg = tiny_gpt2(tmp_path, MUON, "train.schedule=async")
    assert cfg.train.delay_correction == "lookahead"  # async's default
    path = tmp_path / "one.jsonl"
    run_experiment(cfg, path, 6, progress=False)
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    try:
        data = build_data(cfg)
        rows = ResultsWriter(None)
        train(cfg, swarm.pipeline(cfg, run_id, 6, data), data, rows, 6, progress=False)
    finally:
        swarm.unhost(run_id)
    assert_close_losses(step_losses(rows.rows), step_losses(read_results(path)))
