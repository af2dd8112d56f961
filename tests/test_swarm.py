"""The swarm transport on real hivemind (loopback, never mocked).

The oracle: with the same config and seed, stage peers talking over hivemind's P2P reproduce the
single-process run's per-step losses, bytes and evaluations. Stage peers run in this process
(each with its own p2p daemon and DHT node) for speed; one test runs `python -m swarm lab` with
separate processes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest
import torch
from _swarm_env import SMOKE, Swarm, p2pd_count

from protocols import stage_pb2 as pb
from swarm.config import load_config
from swarm.engine.microbatch import MicroBatch
from swarm.network import PROTOCOL_VERSION
from swarm.network.announce import discover
from swarm.network.calls import RemoteError, _Stream, call_info, call_setup, handle_name
from swarm.network.chunks import Assembler, ProtocolError, frame, read_frame, split
from swarm.network.hosted import HostedStage, config_digest
from swarm.network.meta import batch_to_meta, meta_to_batch, raw_to_tensor, tensor_to_raw
from swarm.network.node import NodeOptions, SwarmNode
from swarm.network.pipeline import SwarmPipeline
from swarm.network.servicer import StageServicer
from swarm.network.status import format_table, survey
from swarm.results import ResultsWriter, read_results
from swarm.run import Schedule, build_data, run_experiment, train

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5


def smoke(*overrides: str):
    return load_config(SMOKE, ["train.eval_every=0.5", *overrides])


def swarm_rows(env: Swarm, cfg, steps: int = STEPS, placement=None):
    run_id = uuid.uuid4().hex[:8]
    env.host(cfg, run_id, placement or [(s, s) for s in range(cfg.model.num_stages)])
    try:
        data = build_data(cfg)
        pipeline = env.pipeline(cfg, run_id, steps, data)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, steps, progress=False)
        return results.rows
    finally:
        env.unhost(run_id)


def local_rows(cfg, tmp_path, steps: int = STEPS):
    path = tmp_path / f"local-{uuid.uuid4().hex[:6]}.jsonl"
    run_experiment(cfg, path, steps, progress=False)
    return read_results(path)


def assert_same_run(ours, theirs):
    steps = [r for r in ours if r["type"] == "step"]
    reference = [r for r in theirs if r["type"] == "step"]
    assert len(steps) == len(reference) > 0
    for a, b in zip(steps, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"])
        assert a["bytes"] == b["bytes"]
    evals = [r for r in ours if r["type"] == "eval"]
    reference_evals = [r for r in theirs if r["type"] == "eval"]
    assert len(evals) == len(reference_evals) > 0
    for a, b in zip(evals, reference_evals, strict=True):
        for mode in ("uncompressed", "compressed"):
            for key, value in b[mode].items():
                assert a[mode][key] == pytest.approx(value, rel=1e-5)
    ours_summary, their_summary = (next(r for r in rows if r["type"] == "summary") for rows in (ours, theirs))
    assert ours_summary["bytes"] == their_summary["bytes"]
    assert ours_summary["state_bytes"] == their_summary["state_bytes"]


CODECS = [
    ("none", "none"),
    ("quant:4", "quant:4"),
    ("topk:0.1", "topk:reuse"),
    ("topk:0.1+ef21", "topk:0.1+ef21"),
    ("topk:0.3+aqsgd", "none"),
]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize(("forward", "backward"), CODECS, ids=[f"{f}|{b}" for f, b in CODECS])
def test_oracle_swarm_equals_single_process(swarm, tmp_path, stages, forward, backward):
    cfg = smoke(f"model.num_stages={stages}", f"compression.forward={forward}", f"compression.backward={backward}")
    assert_same_run(swarm_rows(swarm, cfg), local_rows(cfg, tmp_path))


def test_oracle_with_clipping_and_two_peers_on_a_stage(swarm, tmp_path):
    """Gradient clipping across stages, and a stage with two peers: one serves, both step."""
    cfg = smoke("model.num_stages=3", "optimizer.grad_clip=0.05", "compression.forward=topk:0.2+ef21", "compression.backward=topk:reuse")
    rows = swarm_rows(swarm, cfg, placement=[(0, 0), (1, 1), (1, 4), (2, 2)])
    assert_same_run(rows, local_rows(cfg, tmp_path))


# ---- discovery and status ---------------------------------------------------------------------


def test_discovery_sees_several_peers_per_stage_and_status_lists_them(swarm):
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 2), (1, 3)])
    try:
        records = swarm.loop.run(discover(swarm.trainer, run_id, 1))
        assert {r.peer_id for r in records} == {swarm.hosts[i][0].peer_id for i in (1, 2, 3)}
        assert all(r.version == PROTOCOL_VERSION and r.codecs == {"forward": "topk:0.2", "backward": "topk:reuse"} for r in records)
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        assert len(pipeline.members[1]) == 3
        train(cfg, pipeline, data, ResultsWriter(None), 2, progress=False)
        rows = swarm.loop.run(survey(swarm.trainer, run_id))
        assert sorted(r.stage for r in rows) == [0, 1, 1, 1]
        assert all(r.reachable and r.ready for r in rows)
        served = [r for r in rows if r.processed > 0]
        assert {r.stage for r in served} == {0, 1}
        assert any(link["sent"] and link["received"] for r in served for link in r.links)
        (down,) = [link for r in served if r.stage == 0 for link in r.links]
        assert down["raw"]["forward.train"] / down["sent"]["forward.train"] > 4  # topk:0.2: a fifth of the values, in fp16
        ratio = sum(down["raw"].values()) / sum(down["sent"].values())  # with the evaluations' exact tensors
        assert ratio > 1
        assert all(r.rtt_ms is not None and r.rtt_ms > 0 for r in rows)
        table = format_table(rows)
        assert run_id in table and "b0down" in table and "ago" in table and f"(x{ratio:.1f})" in table and "ms" in table
    finally:
        swarm.unhost(run_id)


# ---- integrity, versions, unknown calls --------------------------------------------------------


def test_chunks_verify_length_order_and_checksum():
    payload = os.urandom(3 * 1024 * 1024 + 17)  # > 2 MiB: several chunks
    chunks = list(split(payload))
    assert len(chunks) == 4 and all(len(c.data) <= 1 << 20 for c in chunks)
    assembler = Assembler()
    assert [assembler.add(c) for c in chunks] == [False, False, False, True]
    assert assembler.payload() == payload
    short = Assembler()
    for c in chunks[:2]:
        short.add(c)
    with pytest.raises(ProtocolError, match="truncated"):
        short.payload()
    out_of_order = Assembler()
    out_of_order.add(chunks[0])
    with pytest.raises(ProtocolError, match="expected chunk 1"):
        out_of_order.add(chunks[2])
    (single,) = split(b"activations")
    single.data = b"activatiOns"
    corrupt = Assembler()
    assert corrupt.add(single)
    with pytest.raises(ProtocolError, match="checksum"):
        corrupt.payload()


def test_raw_tensors_and_batch_meta_round_trip_and_validate():
    batch = MicroBatch(3, 1, torch.arange(5), torch.tensor([1, 0, 2, 9, 4]), weight=0.25, exact=True)
    back = meta_to_batch(batch_to_meta(batch))
    assert back.key == batch.key and back.weight == 0.25 and back.exact
    assert torch.equal(back.sample_ids, batch.sample_ids) and torch.equal(back.targets, batch.targets)
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(raw_to_tensor(tensor_to_raw(x)), x)
    raw = tensor_to_raw(x)
    raw.data = raw.data[:-1]
    with pytest.raises(ProtocolError, match="bytes for shape"):
        raw_to_tensor(raw)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        raw_to_tensor(pb.RawTensor(dtype="complex32", shape=[1], data=b"12345678"))
    meta = batch_to_meta(batch)
    meta.targets.CopyFrom(tensor_to_raw(torch.tensor([1, 2])))
    with pytest.raises(ProtocolError, match="do not match"):
        meta_to_batch(meta)


async def _raw_call(p2p, peer_id: str, messages, method: str = "rpc_forward"):
    stream = await _Stream.open(p2p, peer_id, method)
    try:
        for message in messages:
            await stream.send(message)
        await stream.end()
        return await asyncio.wait_for(read_frame(stream.replies()), 20)
    finally:
        stream.close()


def test_bad_payloads_versions_and_unknown_calls_get_one_line_errors(swarm):
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    (hosted,) = swarm.host(cfg, run_id, [(0, 0)])
    peer = hosted.node.peer_id
    p2p = swarm.trainer.p2p
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        ids, x, y = torch.arange(4), torch.stack([data[0][i][1] for i in range(4)]), torch.tensor([data[0][i][2] for i in range(4)])
        batch = MicroBatch(0, 0, ids, y)
        head = pb.MicroBatchHead(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=0, sender=swarm.trainer.peer_id, kind=pb.FORWARD, batch=batch_to_meta(batch), budget_s=10)
        payload = tensor_to_raw(x).SerializeToString()
        good = list(frame(pb.StageRequest, "micro_batch", head, payload))

        corrupted = [pb.StageRequest() for _ in good]
        for a, b in zip(corrupted, good, strict=True):
            a.CopyFrom(b)
        corrupted[0].chunk.crc32 = zlib.crc32(b"something else")
        error, _ = swarm.loop.run(_raw_call(p2p, peer, corrupted))
        assert isinstance(error, pb.ErrorReply) and "checksum" in error.message and "\n" not in error.message

        big = list(frame(pb.StageRequest, "micro_batch", head, os.urandom(3 << 19)))  # two chunks; only the first arrives
        error, _ = swarm.loop.run(_raw_call(p2p, peer, big[:1]))
        assert isinstance(error, pb.ErrorReply) and "truncated" in error.message

        miscounted = [pb.StageRequest()]
        miscounted[0].CopyFrom(good[0])
        miscounted[0].chunk.count = 5000  # a small payload claiming many chunks
        error, _ = swarm.loop.run(_raw_call(p2p, peer, miscounted))
        assert "bad chunk header" in error.message

        huge = [pb.StageRequest()]
        huge[0].CopyFrom(good[0])
        huge[0].chunk.total_length, huge[0].chunk.count = 1 << 40, (1 << 40) >> 20
        error, _ = swarm.loop.run(_raw_call(p2p, peer, huge))
        assert "exceeds this peer's limit" in error.message

        fewer_rows = list(frame(pb.StageRequest, "micro_batch", head, tensor_to_raw(x[:3]).SerializeToString()))
        error, _ = swarm.loop.run(_raw_call(p2p, peer, fewer_rows))
        assert "for 4 samples" in error.message

        future = pb.MicroBatchHead()
        future.CopyFrom(head)
        future.protocol_version = 99
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", future, payload)))
        assert "protocol version 99 is not supported" in error.message

        elsewhere = pb.MicroBatchHead()
        elsewhere.CopyFrom(head)
        elsewhere.stage = 5
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", elsewhere, payload)))
        assert "does not host stage 5" in error.message

        bad_targets = pb.MicroBatchHead()
        bad_targets.CopyFrom(head)
        bad_targets.batch.targets.data = b"\x00"
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", bad_targets, payload)))
        assert "targets" in error.message

        with pytest.raises(Exception):  # noqa: B017 (hivemind reports an unknown protocol in several ways)
            swarm.loop.run(asyncio.wait_for(p2p.call_protobuf_handler(hosted.node.p2p.peer_id, handle_name("rpc_bogus"), pb.InfoRequest(), pb.InfoReply), 10))
        reply = swarm.loop.run(call_info(p2p, peer, "", 10))
        assert reply.peer_id == peer
        old = swarm.loop.run(p2p.call_protobuf_handler(hosted.node.p2p.peer_id, handle_name("rpc_info"), pb.InfoRequest(protocol_version=0), pb.InfoReply))
        assert "protocol version 0" in old.error
        with pytest.raises(RemoteError, match="config mismatch"):
            request = pb.SetupRequest(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=0, config_digest="0" * 16, lr_horizon=2)
            swarm.loop.run(call_setup(p2p, peer, request, 10))

        # the peer kept serving: a good micro-batch still trains
        metrics = pipeline.run(batch, x)
        assert metrics["count"] == 4 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert hosted.processed == 1
    finally:
        swarm.unhost(run_id)


def test_config_digest_covers_what_stages_compute():
    base = smoke()
    assert config_digest(base) == config_digest(smoke("train.batch_size=20", "name=other", "compression.store_dir=/tmp/elsewhere"))
    assert config_digest(base) != config_digest(smoke("compression.forward=quant:4", "compression.backward=none"))
    assert config_digest(base) != config_digest(smoke("seed=1"))


# ---- separate processes ---------------------------------------------------------------------


def test_lab_runs_separate_processes_and_matches_single_process(tmp_path):
    before = p2pd_count()
    results = tmp_path / "lab.jsonl"
    overrides = ["compression.forward=topk:0.1+ef21", "compression.backward=topk:reuse", "train.eval_every=100"]
    sets = [a for o in overrides for a in ("--set", o)]
    out = subprocess.run(
        [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "2", "--steps", "2", "--results", str(results), "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "1", *sets],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[stage0]" in out.stdout and "[stage1]" in out.stdout and "[trainer] step 2" in out.stdout
    cfg = load_config(SMOKE, [*overrides, "model.num_stages=2"])
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))
    assert sorted(p.name for p in (tmp_path / "ck" / "step-00000002").iterdir()) == ["stage0.pt", "stage1.pt", "trainer.pt"]
    (stages,) = [r for r in read_results(results) if r["type"] == "stages"]  # what the throughput benchmark reads
    assert sorted(s["stage"] for s in stages["stages"]) == [0, 1] and all(s["compute_s"] > 0 and s["samples"] == 2 * 40 for s in stages["stages"])
    assert p2pd_count() == before  # every daemon the lab started is gone


def test_a_killed_peer_is_banned_and_the_micro_batch_retried_on_another(swarm):
    """Stage 1 has two peers; the one serving dies mid-run; stage 0 retries on the other."""
    cfg = smoke("model.num_stages=3", "compression.forward=topk:0.2+ef21", "compression.backward=topk:reuse")
    run_id = uuid.uuid4().hex[:8]
    victim, victim_servicer = swarm.mortal_host()
    try:
        hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
        backup = hosted[1]
        doomed = victim_servicer.host(HostedStage(victim, run_id, cfg, 1, timeout=30))
        swarm.loop.run(victim_servicer.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 4, data)
        assert len(pipeline.members[1]) == 2
        hosted[0].downstream = victim.peer_id  # make the victim the peer in use
        schedule = split_batches(cfg, data)
        for batch, x in schedule[0]:
            pipeline.run(batch, x)
        pipeline.step()
        assert doomed.processed == cfg.train.micro_batches and backup.processed == 0
        swarm.loop.run(victim_servicer.stop())
        swarm.loop.run(victim.shutdown())
        losses = []
        for step in schedule[1:3]:
            losses += [pipeline.run(batch, x)["loss"] for batch, x in step]
            pipeline.step()
        assert backup.processed == 2 * cfg.train.micro_batches
        assert all(torch.isfinite(torch.tensor(losses)))
        assert victim.peer_id not in pipeline.members[1]
        assert hosted[0].router.bans.banned(victim.peer_id)
    finally:
        swarm.unhost(run_id)


def split_batches(cfg, data, steps: int = 3):
    """The first `steps` steps' (MicroBatch, inputs) pairs, as swarm.run.train would make them."""
    from swarm.data import collate
    from swarm.engine.microbatch import Mode
    from swarm.run import split_micro_batches

    train_set = data[0]
    out = []
    for step in range(steps):
        items = [train_set[i] for i in range(step * cfg.train.batch_size, (step + 1) * cfg.train.batch_size)]
        ids, inputs, targets = collate(items)
        out.append(split_micro_batches(step, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, False))
    return out


# ---- several micro-batches in flight, replicas, lost peers and links ----------------------------


def _reference(cfg, data, steps: int = 3):
    from swarm.engine.build import build_local_pipeline

    return build_local_pipeline(cfg, Schedule.of(cfg, len(data[0]), steps).lr_horizon, capacity=len(data[0]))[0]


def _only(router, keep: str, others) -> None:
    """Routes to `keep` alone (the others banned for now)."""
    router.bans.until = {peer: float("inf") for peer in others if peer != keep}


def test_micro_batches_overlap_in_the_pipeline(swarm, tmp_path):
    cfg = smoke("model.num_stages=4", "compression.forward=topk:0.1+ef21", "compression.backward=topk:0.1+ef21", "train.micro_batches=8", "train.batch_size=32")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(4)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, 3, progress=False)
    finally:
        swarm.unhost(run_id)
    assert pipeline.in_flight == 8
    assert max(h.peak_queue for h in hosted) > 1  # a stage held several micro-batches at once
    assert_same_run(results.rows, local_rows(cfg, tmp_path, steps=3))


def test_replicas_of_a_stage_stay_identical_when_micro_batches_split_between_them(swarm):
    cfg = smoke("model.num_stages=3", "compression.forward=none", "compression.backward=none")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 4), (2, 2)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        local = _reference(cfg, data)
        replicas = [hosted[1], hosted[2]]
        ids = [h.node.peer_id for h in replicas]
        for items in split_batches(cfg, data):
            ours = []
            for i, (batch, x) in enumerate(items):
                _only(hosted[0].router, ids[i % 2], ids)
                hosted[0].downstream = None
                ours.append(pipeline.run(batch, x)["loss"])
            assert ours == pytest.approx([m["loss"] for m in local.run_many(items)], rel=1e-6)
            assert pipeline.step() == pytest.approx(local.step())
        assert all(h.processed == 6 for h in replicas)
        for p, q, r in zip(*(m.parameters() for m in (replicas[0].runtime.module, replicas[1].runtime.module, local.runtimes[1].module)), strict=True):
            assert torch.equal(p, q)
            assert torch.allclose(p, r, rtol=1e-5, atol=1e-7)
    finally:
        swarm.unhost(run_id)


def test_a_peer_that_dies_holding_a_steps_gradients_has_them_recomputed(swarm):
    """Stage 1's serving peer dies after every micro-batch of a step went through it, before the
    step: the trainer re-runs those micro-batches on the other peer, and training stays exact."""
    cfg = smoke("model.num_stages=3", "compression.forward=none", "compression.backward=none")
    run_id = uuid.uuid4().hex[:8]
    victim, victim_servicer = swarm.mortal_host()
    try:
        hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
        doomed = victim_servicer.host(HostedStage(victim, run_id, cfg, 1, timeout=30))
        swarm.loop.run(victim_servicer.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        local = _reference(cfg, data)
        ids = [victim.peer_id, hosted[1].node.peer_id]
        _only(hosted[0].router, victim.peer_id, ids)
        steps = split_batches(cfg, data)
        for n, items in enumerate(steps):
            ours = [m["loss"] for m in pipeline.run_many(items)]
            assert ours == pytest.approx([m["loss"] for m in local.run_many(items)], rel=1e-6)
            if n == 1:
                assert doomed.processed == 2 * len(items) and hosted[1].processed == 0
                swarm.loop.run(victim_servicer.stop())
                swarm.loop.run(victim.shutdown())
                hosted[0].router.bans.until.clear()
            assert pipeline.step() == pytest.approx(local.step())
        assert hosted[1].processed == 2 * len(steps[0])  # step 1 re-run, then step 2
        assert victim.peer_id not in pipeline.members[1]
        for p, r in zip(hosted[1].runtime.module.parameters(), local.runtimes[1].module.parameters(), strict=True):
            assert torch.allclose(p, r, rtol=1e-5, atol=1e-7)
    finally:
        swarm.unhost(run_id)


def test_a_link_whose_receiver_lost_its_state_restarts_on_both_ends(swarm):
    cfg = smoke("model.num_stages=2", "compression.forward=topk:0.2+ef21", "compression.backward=topk:0.2+ef21")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        steps = split_batches(cfg, data)
        receiver = hosted[1].node.peer_id
        pipeline.run_many(steps[0])
        pipeline.step()
        epoch = hosted[0].out_links[receiver].epoch

        hosted[1].link_grace = 0.5  # as if stage 1 restarted: it knows nothing of the link
        hosted[1].turnstiles.clear()
        hosted[1].ends_in.clear()
        losses = [m["loss"] for m in pipeline.run_many(steps[1])]
        pipeline.step()
        assert all(torch.isfinite(torch.tensor(losses)))
        assert hosted[0].out_links[receiver].epoch > epoch
        epoch = hosted[0].out_links[receiver].epoch

        table = hosted[1].ends_in[hosted[0].node.peer_id].receiver.table  # its mirrored state moves on alone
        table._buffers = {shape: (buf, version + 7) for shape, (buf, version) in table._buffers.items()}
        losses = [m["loss"] for m in pipeline.run_many(steps[2])]
        pipeline.step()
        assert all(torch.isfinite(torch.tensor(losses)))
        assert hosted[0].out_links[receiver].epoch > epoch
    finally:
        swarm.unhost(run_id)


def test_swarm_checkpoint_resumes_exactly_in_the_swarm_and_in_one_process(swarm, tmp_path):
    """Checkpoints every 2 steps of 4; the last one is lost, as if the trainer died after step 3.
    A new trainer session resumes the swarm from step 2, and a single-process run resumes the same
    files: both repeat the uninterrupted run, error-feedback state included."""
    import shutil

    from swarm.run import Checkpointing

    cfg = smoke("model.num_stages=3", "compression.forward=topk:0.2+ef21", "compression.backward=topk:0.2+ef21", "train.eval_every=100")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    directory = tmp_path / "ckpt"
    try:
        data = build_data(cfg)
        first = ResultsWriter(None)
        train(cfg, swarm.pipeline(cfg, run_id, 4, data), data, first, 4, progress=False, checkpoint=Checkpointing(str(directory), 2))
        assert sorted(p.name for p in directory.iterdir()) == ["step-00000002", "step-00000004"]
        assert sorted(p.name for p in (directory / "step-00000002").iterdir()) == ["stage0.pt", "stage1.pt", "stage2.pt", "trainer.pt"]
        shutil.rmtree(directory / "step-00000004")
        resumed = ResultsWriter(None)
        train(cfg, swarm.pipeline(cfg, run_id, 4, data), data, resumed, 4, progress=False, checkpoint=Checkpointing(str(directory), 2))
    finally:
        swarm.unhost(run_id)
    uninterrupted = local_rows(cfg, tmp_path, steps=4)
    reference = [r["loss"] for r in uninterrupted if r["type"] == "step"]
    losses = [r["loss"] for r in first.rows if r["type"] == "step"]
    assert losses == pytest.approx(reference, rel=1e-5)
    after = [r["loss"] for r in resumed.rows if r["type"] == "step"]
    assert [r["step"] for r in resumed.rows if r["type"] == "step"] == [3, 4]
    assert after == pytest.approx(reference[2:], rel=1e-5)
    shutil.rmtree(directory / "step-00000004")
    local = tmp_path / "local.jsonl"
    run_experiment(cfg, local, 4, progress=False, checkpoint=Checkpointing(str(directory), 2))
    assert [r["loss"] for r in read_results(local) if r["type"] == "step"] == pytest.approx(reference[2:], rel=1e-5)


@pytest.mark.parametrize("shaping", ["netns", "inprocess"])
def test_shaped_lab_reports_its_links_and_keeps_the_numerics(tmp_path, shaping):
    import re

    from swarm.netlab.namespaces import list_namespaces

    results = tmp_path / "shaped.jsonl"
    namespaces = set(list_namespaces("hp"))
    out = subprocess.run(
        [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "2", "--steps", "2", "--results", str(results), "--bandwidth", "stage1=20mbit,*=50mbit", "--delay", "5ms", "--shaping", shaping, "--set", "train.eval_every=100"],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if shaping == "netns":
        assert "stage1     10.77.0.4       up tbf 20mbit" in out.stdout and "trainer    10.77.0.5       up tbf 50mbit" in out.stdout
        probe = re.search(r"probe trainer<->stage1: up ([0-9.]+) Mbit/s, down ([0-9.]+) Mbit/s", out.stdout)
        assert probe and all(5 < float(v) <= 20.5 for v in probe.groups())  # the 20mbit link binds
        assert set(list_namespaces("hp")) == namespaces  # all torn down
    else:
        assert "in-process shaping: bootstrap 50mbit, stage0 50mbit, stage1 20mbit, trainer 50mbit; delay 5ms" in out.stdout
    cfg = load_config(SMOKE, ["train.eval_every=100", "model.num_stages=2"])
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))


def test_in_process_shaping_paces_every_payload_a_peer_sends(swarm):
    """Peers created with a shape rate send requests and replies through their token bucket."""
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    shaped = [swarm.loop.run(SwarmNode.create(NodeOptions(initial_peers=swarm.maddrs, shape_rate="200mbit", shape_delay="1ms", client_mode=client))) for client in (False, False, True)]
    servicers = [StageServicer(node) for node in shaped[:2]]
    try:
        for stage, servicer in enumerate(servicers):
            swarm.loop.run(servicer.start())
            servicer.host(HostedStage(servicer.node, run_id, cfg, stage, timeout=30))
            swarm.loop.run(servicer.announcer.announce_now())
        data = build_data(cfg)
        pipeline = SwarmPipeline(shaped[2], swarm.loop, cfg, run_id, timeout=30)
        pipeline.setup(Schedule.of(cfg, len(data[0]), 2).lr_horizon, len(data[0]), wait_s=20)
        items = split_batches(cfg, data, 1)[0]
        pipeline.run_many(items)
        pipeline.step()
        inputs = sum(len(tensor_to_raw(x).SerializeToString()) for _, x in items)
        sent = pipeline.link_bytes()
        stage0, stage1, trainer = (node.egress.stats() for node in shaped)
        assert trainer.bytes > inputs and trainer.rate_bits == 200_000_000 and trainer.delay_s == 0.001
        assert stage0.bytes > sent["boundary0.forward.train"]  # activations out (and replies to the trainer)
        assert stage1.bytes > sent["boundary0.backward.train"]  # gradients back, as replies
    finally:
        for servicer in servicers:
            swarm.loop.run(servicer.stop())
        for node in shaped:
            swarm.loop.run(node.shutdown())
