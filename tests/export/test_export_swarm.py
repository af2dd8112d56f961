"""Exports of swarm runs (the shared in-process swarm): a from-scratch GPT-2 from its checkpoint,
from the live swarm's copies (the owner only) and at the run's end; a Llama fine-tuned in full,
sampled through the swarm as it trains. Each loads with transformers and gives the stages' logits."""

from __future__ import annotations

import signal
import uuid

import pytest
import torch
from _export_cases import (
    assert_same_tensors,
    assert_tensorboard_has_the_rows,
    loaded_logits,
    probe,
    saved_tensors,
    stage_logits,
    tiny_llama,
)
from _swarm_env import local_rows, step_losses, tiny_gpt2
from hivemind.utils.crypto import RSAPrivateKey
from transformers import AutoModelForCausalLM

from swarm.export.exporter import ExportOptions, export_pipeline, export_run
from swarm.export.live import LiveRun, live_state
from swarm.export.state import checkpoint_state
from swarm.training.checkpoints import Checkpointing, run_dir
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter, read_results
from swarm.transport.hivemind.net.node import SwarmNode

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)


def _trained(swarm, cfg, run_id: str, steps: int, checkpoint=None):
    """`steps` steps of `cfg` through the swarm (copies every 2 steps); the pipeline, its rows."""
    data = build_data(cfg)
    pipeline = swarm.pipeline(cfg, run_id, steps, data, snapshot_every=2)
    results = ResultsWriter(None)
    train(cfg, pipeline, data, results, steps, progress=False, checkpoint=checkpoint)
    return pipeline, results.rows


def test_a_gpt2_trained_from_scratch_exports_from_its_checkpoint_its_live_copies_and_its_end(swarm, tmp_path):
    cfg = tiny_gpt2(tmp_path)  # 3 stages, the embedding and the LM head tied across stages 0 and 2
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(3)])
    exporter = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    try:
        ck = tmp_path / "ck"
        pipeline, _ = _trained(swarm, cfg, run_id, 4, Checkpointing(str(ck), every=2, keep=3))
        lines = export_run(checkpoint_state(ck), ExportOptions(tmp_path / "from-checkpoint"))
        assert lines[0].startswith(f"gpt2 model of step 4 (AutoModelForCausalLM.from_pretrained) from checkpoint {ck}")
        saved = saved_tensors(tmp_path / "from-checkpoint")
        assert "transformer.wte.weight" in saved and "lm_head.weight" not in saved  # the tied head once
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "from-checkpoint")
        assert model.lm_head.weight is model.transformer.wte.weight
        tokens = probe(260)
        ours = loaded_logits(model, tokens)
        theirs = stage_logits([h.runtime.module for h in sorted(hosted, key=lambda h: h.stage)], tokens)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)

        # the trainer's --export: the stages' state at the run's end, fetched from the stage peers
        export_pipeline(pipeline, cfg, 4, ExportOptions(tmp_path / "at-the-end"))
        assert_same_tensors(saved_tensors(tmp_path / "at-the-end"), saved)

        # the live swarm: its newest copies (step 2), fetched with the owner's key
        live = swarm.loop.run(live_state(exporter, run_id, RSAPrivateKey.process_wide(), cfg, 30))
        assert live.step == 2 and live.source == f"run {run_id}'s copies of step 2"
        export_run(live, ExportOptions(tmp_path / "live"))
        export_run(checkpoint_state(run_dir(ck, 2)), ExportOptions(tmp_path / "step-2"))
        assert_same_tensors(saved_tensors(tmp_path / "live"), saved_tensors(tmp_path / "step-2"))

        # anyone else: no manifest of theirs names a copy, and the stage peers refuse their admission
        stranger = LiveRun(exporter, run_id, RSAPrivateKey(), 30)
        with pytest.raises(ValueError, match=r"hold no complete set of copies signed by owner"):
            swarm.loop.run(stranger.state(cfg))
        owner = LiveRun(exporter, run_id, RSAPrivateKey.process_wide(), 30)
        source = [(swarm.hosts[0][0].peer_id, 0)]
        with pytest.raises(ValueError, match=r"not by the run's owner"):  # the stage peer's gate
            swarm.loop.run(stranger._download(0, 2, source, owner_named(swarm, owner, cfg)))
    finally:
        swarm.loop.run(exporter.shutdown())
        swarm.unhost(run_id)


def owner_named(swarm, owner: LiveRun, cfg):
    """What the owner's manifest names of stage 0's copies of step 2 (shown by its peers)."""
    from swarm.transport.hivemind.trainer.copies import named_of, shown_manifests
    from swarm.transport.hivemind.trainer.membership import stage_statuses

    peers = [(0, swarm.hosts[0][0].peer_id)]
    statuses = swarm.loop.run(stage_statuses(owner.node, owner.run_id, peers, 30))
    accepted = shown_manifests(statuses, owner.owner, owner.run_id)
    return next(named_of(accepted, lineage, 2, 0) for lineage, step in accepted if step == 2)


def test_a_llama_fine_tuned_in_full_samples_through_the_swarm_and_exports_the_stages_logits(swarm, tmp_path):
    """Samples at every evaluation (temperature 0.7: drawn): the swarm samples what one process
    samples, and its losses are one process's."""
    cfg = tiny_llama(tmp_path, "train.sample_every=1", "train.sample_tokens=4", "train.sample_temperature=0.7")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(3)])
    try:
        pipeline, rows = _trained(swarm, cfg, run_id, 4)
        export_pipeline(pipeline, cfg, 4, ExportOptions(tmp_path / "model"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
        tokens = probe()
        theirs = stage_logits([h.runtime.module for h in sorted(hosted, key=lambda h: h.stage)], tokens)
        torch.testing.assert_close(loaded_logits(model, tokens), theirs, rtol=1e-5, atol=1e-6)
    finally:
        swarm.unhost(run_id)
    one_process = local_rows(cfg, tmp_path, 4)  # samples too: without them, test_sampling.py
    assert step_losses(rows) == pytest.approx(step_losses(one_process), rel=1e-5)
    samples = [r for r in rows if r["type"] == "sample"]
    assert [r["step"] for r in samples] == [r["step"] for r in rows if r["type"] == "eval"] == [2, 4]
    assert samples == [r for r in one_process if r["type"] == "sample"]
    assert all(len(r["tokens"]) == 4 and r["prompt"] for r in samples)


def test_the_trainer_exports_at_the_runs_end_and_writes_tensorboard_the_results_rows(swarm, tmp_path):
    """peers.trainer in this process over the shared swarm, with --export and --tensorboard."""
    from peers.trainer import main as trainer_main

    cfg = tiny_gpt2(tmp_path)
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(3)])
    handler = signal.getsignal(signal.SIGTERM)  # the trainer's main() takes SIGTERM over
    results, board, out = tmp_path / "run.jsonl", tmp_path / "tb", tmp_path / "model"
    try:
        code = trainer_main(
            [
                *("--config", str(tmp_path / "tied.yaml"), "--run_id", run_id, "--steps", "3"),
                *("--initial_peers", *swarm.maddrs, "--wait", "30", "--identity_path", str(tmp_path / "owner.key")),
                *("--results", str(results), "--export", str(out), "--tensorboard", str(board)),
            ]
        )
        assert code == 0
        tokens = probe(260)
        theirs = stage_logits([h.runtime.module for h in sorted(hosted, key=lambda h: h.stage)], tokens)
        model = AutoModelForCausalLM.from_pretrained(out)
        torch.testing.assert_close(loaded_logits(model, tokens), theirs, rtol=1e-5, atol=1e-6)
    finally:
        signal.signal(signal.SIGTERM, handler)
        swarm.unhost(run_id)
    assert_tensorboard_has_the_rows(board, read_results(results))
