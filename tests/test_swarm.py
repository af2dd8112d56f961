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
from _swarm_env import SMOKE, assert_same_run, local_rows, p2pd_count, smoke, split_batches, swarm_rows
from google.protobuf.message import DecodeError

from protocols import stage_pb2 as pb
from protocols.framing import CHUNK_BYTES, Assembler, ProtocolError, frame, frame_parts, parse_message, read_frame
from swarm.config import load_config
from swarm.engine.build import config_digest
from swarm.engine.microbatch import MicroBatch
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter, read_results
from swarm.transport.hivemind import PROTOCOL_VERSION, loop
from swarm.transport.hivemind.announce import discover
from swarm.transport.hivemind.calls import call
from swarm.transport.hivemind.errors import RemoteError
from swarm.transport.hivemind.meta import batch_to_meta, meta_to_batch, raw_to_tensor, tensor_to_raw
from swarm.transport.hivemind.node import DAEMON_THREADS, NodeOptions, SwarmNode
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.streams import PeerStream
from swarm.transport.hivemind.survey import format_table, survey
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline

ROOT = Path(__file__).resolve().parents[1]
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
    cfg = smoke(
        "model.num_stages=3",
        "optimizer.grad_clip=0.05",
        "compression.forward=topk:0.2+ef21",
        "compression.backward=topk:reuse",
    )
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
        assert all(
            r.version == PROTOCOL_VERSION and r.codecs == {"forward": "topk:0.2", "backward": "topk:reuse"}
            for r in records
        )
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
        assert (
            down["raw"]["forward.train"] / down["sent"]["forward.train"] > 4
        )  # topk:0.2: a fifth of the values, in fp16
        ratio = sum(down["raw"].values()) / sum(down["sent"].values())  # with the evaluations' exact tensors
        assert ratio > 1
        assert all(r.rtt_ms is not None and r.rtt_ms > 0 for r in rows)
        table = format_table(rows)
        assert run_id in table and "b0down" in table and "ago" in table and f"(x{ratio:.1f})" in table and "ms" in table
    finally:
        swarm.unhost(run_id)


# ---- integrity, versions, unknown calls --------------------------------------------------------


def test_peers_run_on_uvloop():
    """The peers' loops (peers._common.run_until_stopped, LoopThread) are uvloop's where it is installed."""

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert loop.run(loop_module()).startswith("uvloop")
    thread = loop.LoopThread("test-uvloop")
    try:
        assert thread.run(loop_module(), timeout=10).startswith("uvloop")
    finally:
        thread.stop()


def test_p2p_daemons_run_on_the_threads_a_peer_is_given(swarm):
    """--daemon_threads reaches the p2p daemon as GOMAXPROCS (0: Go's default), and only the daemon."""
    before = os.environ.get("GOMAXPROCS")
    nodes = [
        swarm.loop.run(SwarmNode.create(NodeOptions(initial_peers=swarm.maddrs, client_mode=True, daemon_threads=n)))
        for n in (DAEMON_THREADS, 3, 0)
    ]
    try:
        seen = []
        for node in nodes:
            with open(f"/proc/{node.p2p._child.pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            seen.append(env.get(b"GOMAXPROCS"))
        assert seen == [str(DAEMON_THREADS).encode(), b"3", None]
        assert os.environ.get("GOMAXPROCS") == before
    finally:
        for node in nodes:
            swarm.loop.run(node.shutdown())
    with pytest.raises(
        RuntimeError, match=r"^--daemon_threads must be 0 \(one per core\) or a positive integer, got -1$"
    ):
        swarm.loop.run(SwarmNode.create(NodeOptions(initial_peers=swarm.maddrs, daemon_threads=-1)))


def _chunks(payload: bytes) -> list[pb.Chunk]:
    return [m.chunk for m in frame(pb.StageRequest, "micro_batch", pb.MicroBatchHead(), payload)]


def test_framed_parts_are_what_protobuf_writes_and_view_the_payload():
    """frame_parts writes each message as protobuf would (chunk fields filled, then serialized), the
    data a view of the payload, for heads with and without fields and payloads of 0 to 4 chunks."""
    heads = [
        (pb.StageRequest, "micro_batch", pb.MicroBatchHead(to=pb.Address(run_id="r", stage=2), budget_s=3.5)),
        (pb.StageReply, "micro_batch", pb.ResultHead()),
        (pb.StageRequest, "gather", pb.GatherRequest()),
        (pb.StageReply, "error", pb.ErrorReply(message="no")),
    ]
    for size in (0, 1, 300, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 17):
        payload = os.urandom(size)
        count = max(1, -(-size // CHUNK_BYTES))
        for message_type, field, head in heads:
            framed = list(frame_parts(message_type, field, head, payload))
            assert len(framed) == count
            for i, parts in enumerate(framed):
                expected = message_type(**{field: head}) if i == 0 else message_type()
                expected.chunk.index, expected.chunk.count, expected.chunk.total_length, expected.chunk.crc32 = (
                    i,
                    count,
                    size,
                    zlib.crc32(payload),
                )
                expected.chunk.data = payload[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]
                assert b"".join(parts) == expected.SerializeToString(), (size, field, i)
                assert size == 0 or parts[-1].obj is payload  # not a copy
            assert [m.SerializeToString() for m in frame(message_type, field, head, payload)] == [
                b"".join(parts) for parts in framed
            ]


def test_received_messages_keep_their_chunk_data_as_a_view_and_parse_as_protobuf_does():
    """parse_message leaves a framed chunk's data out of the parsed message (a view of the bytes
    received); a message laid out otherwise (chunk first, a field after it, the chunk twice) is
    parsed whole, and garbage fails as protobuf fails."""
    payload = os.urandom(CHUNK_BYTES + 300)
    head = pb.MicroBatchHead(to=pb.Address(run_id="r", stage=1))
    for parts in frame_parts(pb.StageRequest, "micro_batch", head, payload):
        data = b"".join(parts)
        message, view = parse_message(pb.StageRequest, data)
        assert isinstance(view, memoryview) and view.obj is data and len(view) == len(parts[1])
        assert not message.chunk.data
        message.chunk.data = bytes(view)
        assert message == pb.StageRequest.FromString(data)
    whole = pb.StageRequest(micro_batch=head, chunk=pb.Chunk(index=0, count=1, total_length=3, crc32=7, data=b"abc"))
    chunk_first = whole.chunk.SerializeToString()
    chunk_first = (
        b"\x7a" + bytes([len(chunk_first)]) + chunk_first + pb.StageRequest(micro_batch=head).SerializeToString()
    )
    twice = whole.SerializeToString() + pb.StageRequest(chunk=pb.Chunk(data=b"xyz")).SerializeToString()
    trailing = (
        whole.SerializeToString()
        + pb.StageRequest(micro_batch=pb.MicroBatchHead(to=pb.Address(stage=9))).SerializeToString()
    )
    for data in (chunk_first, twice, trailing):
        message, view = parse_message(pb.StageRequest, data)
        assert view is None and message == pb.StageRequest.FromString(data)
    assert (
        parse_message(pb.StageRequest, twice).message.chunk.data == b"xyz"
        and parse_message(pb.StageRequest, trailing).message.micro_batch.to.stage == 9
    )
    for garbage in (whole.SerializeToString()[:-1], b"\x22\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0f"):
        with pytest.raises(DecodeError):
            pb.StageRequest.FromString(garbage)
        with pytest.raises(DecodeError):
            parse_message(pb.StageRequest, garbage)


def test_chunks_verify_length_order_and_checksum():
    payload = os.urandom(3 * 1024 * 1024 + 17)  # > 2 MiB: several chunks
    chunks = _chunks(payload)
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
    (single,) = _chunks(b"activations")
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


async def _raw_call(p2p, peer_id: str, messages):
    """The reply to these request messages, sent as they are (a well-behaved caller frames them)."""
    stream = await PeerStream.open(p2p, peer_id)
    try:
        await stream.send([(message.SerializeToString(),) for message in messages])
        await stream.end()
        frame = await asyncio.wait_for(read_frame(stream.replies()), 20)
        return frame.head, frame.payload
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
        ids, x, y = (
            torch.arange(4),
            torch.stack([data[0][i][1] for i in range(4)]),
            torch.tensor([data[0][i][2] for i in range(4)]),
        )
        batch = MicroBatch(0, 0, ids, y)
        head = pb.MicroBatchHead(
            to=pb.Address(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=0),
            sender=swarm.trainer.peer_id,
            batch=batch_to_meta(batch),
            budget_s=10,
        )
        payload = tensor_to_raw(x).SerializeToString()
        good = list(frame(pb.StageRequest, "micro_batch", head, payload))

        corrupted = [pb.StageRequest() for _ in good]
        for a, b in zip(corrupted, good, strict=True):
            a.CopyFrom(b)
        corrupted[0].chunk.crc32 = zlib.crc32(b"something else")
        error, _ = swarm.loop.run(_raw_call(p2p, peer, corrupted))
        assert isinstance(error, pb.ErrorReply) and "checksum" in error.message and "\n" not in error.message

        big = list(
            frame(pb.StageRequest, "micro_batch", head, os.urandom(3 << 19))
        )  # two chunks; only the first arrives
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
        future.to.protocol_version = 99
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", future, payload)))
        assert "protocol version 99 is not supported" in error.message

        elsewhere = pb.MicroBatchHead()
        elsewhere.CopyFrom(head)
        elsewhere.to.stage = 5
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", elsewhere, payload)))
        assert "does not host stage 5" in error.message

        bad_targets = pb.MicroBatchHead()
        bad_targets.CopyFrom(head)
        bad_targets.batch.targets.data = b"\x00"
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", bad_targets, payload)))
        assert "targets" in error.message

        headless = [pb.StageRequest(chunk=good[0].chunk)]  # a request of no kind this peer knows
        error, _ = swarm.loop.run(_raw_call(p2p, peer, headless))
        assert isinstance(error, pb.ErrorReply) and error.message == "the first message has no head"

        with pytest.raises(Exception):  # noqa: B017 (hivemind reports an unknown protocol in several ways)
            swarm.loop.run(
                asyncio.wait_for(p2p.call_binary_stream_handler(hosted.node.p2p.peer_id, "hivepipe.bogus"), 10)
            )
        streams = swarm.trainer.streams
        current = pb.Address(protocol_version=PROTOCOL_VERSION)
        reply = swarm.loop.run(call(streams, peer, "info", pb.InfoRequest(to=current), timeout=10)).head
        assert reply.peer_id == peer and [s.run_id for s in reply.stages] == [run_id]
        with pytest.raises(RemoteError, match="protocol version 0 is not supported"):
            swarm.loop.run(call(streams, peer, "info", pb.InfoRequest(to=pb.Address(protocol_version=0)), timeout=10))
        with pytest.raises(RemoteError, match="config mismatch"):
            to = pb.Address(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=0)
            request = pb.SetupRequest(to=to, config_digest="0" * 16, lr_horizon=2)
            swarm.loop.run(call(streams, peer, "setup", request, timeout=10))

        # the peer kept serving: a good micro-batch still trains
        metrics = pipeline.run_many([(batch, x)])[0]
        assert metrics["count"] == 4 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert hosted.processed == 1
    finally:
        swarm.unhost(run_id)


def test_config_digest_covers_what_stages_compute():
    base = smoke()
    assert config_digest(base) == config_digest(
        smoke("train.batch_size=20", "name=other", "compression.store_dir=/tmp/elsewhere")
    )
    assert config_digest(base) != config_digest(smoke("compression.forward=quant:4", "compression.backward=none"))
    assert config_digest(base) != config_digest(smoke("seed=1"))


# ---- separate processes ---------------------------------------------------------------------


def test_lab_runs_separate_processes_and_matches_single_process(tmp_path):
    before = p2pd_count()
    results = tmp_path / "lab.jsonl"
    overrides = ["compression.forward=topk:0.1+ef21", "compression.backward=topk:reuse", "train.eval_every=100"]
    sets = [a for o in overrides for a in ("--set", o)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm",
            "lab",
            str(SMOKE),
            "--stages",
            "2",
            "--steps",
            "2",
            "--results",
            str(results),
            "--checkpoint_dir",
            str(tmp_path / "ck"),
            "--checkpoint_every",
            "1",
            *sets,
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[stage0]" in out.stdout and "[stage1]" in out.stdout and "[trainer] step 2" in out.stdout
    cfg = load_config(SMOKE, [*overrides, "model.num_stages=2"])
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))
    assert sorted(p.name for p in (tmp_path / "ck" / "step-00000002").iterdir()) == [
        "stage0.pt",
        "stage1.pt",
        "trainer.pt",
    ]
    (stages,) = [r for r in read_results(results) if r["type"] == "stages"]  # what the throughput benchmark reads
    assert sorted(s["stage"] for s in stages["stages"]) == [0, 1] and all(
        s["compute_s"] > 0 and s["samples"] == 2 * 40 for s in stages["stages"]
    )
    assert all(
        0 < s["compute_cpu_s"] < 2 * s["compute_s"] for s in stages["stages"]
    )  # the computing thread's CPU time, one torch thread
    steps = [r for r in read_results(results) if r["type"] == "step"]  # each carries the stages' compute so far
    assert [sorted((p["stage"], p["samples"]) for p in r["stages"]) for r in steps] == [
        [(0, 40), (1, 40)],
        [(0, 80), (1, 80)],
    ]
    assert all(
        0 < p["compute_s"] <= q["compute_s"] for p, q in zip(steps[0]["stages"], steps[1]["stages"], strict=True)
    )
    threads = max(1, len(os.sched_getaffinity(0)) // 3)  # two stage peers and the trainer share the cores
    assert f"[lab] torch threads per peer: {threads}" in out.stdout
    assert p2pd_count() == before  # every daemon the lab started is gone


@pytest.mark.parametrize("shaping", ["netns", "inprocess"])
def test_shaped_lab_reports_its_links_and_keeps_the_numerics(tmp_path, shaping):
    import re

    from swarm.netlab.namespaces import list_namespaces

    results = tmp_path / "shaped.jsonl"
    namespaces = set(list_namespaces("hp"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm",
            "lab",
            str(SMOKE),
            "--stages",
            "2",
            "--steps",
            "2",
            "--results",
            str(results),
            "--bandwidth",
            "stage1=20mbit,*=50mbit",
            "--delay",
            "5ms",
            "--shaping",
            shaping,
            "--set",
            "train.eval_every=100",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if shaping == "netns":
        assert (
            "stage1     10.77.0.4       up tbf 20mbit" in out.stdout
            and "trainer    10.77.0.5       up tbf 50mbit" in out.stdout
        )
        probe = re.search(r"probe trainer<->stage1: up ([0-9.]+) Mbit/s, down ([0-9.]+) Mbit/s", out.stdout)
        assert probe and all(5 < float(v) <= 20.5 for v in probe.groups())  # the 20mbit link binds
        assert re.search(r"probe trainer<->bootstrap: up [0-9.]+ Mbit/s", out.stdout)  # every access link is crossed
        assert set(list_namespaces("hp")) == namespaces  # all torn down
        rows = read_results(results)
        meter = next(r for r in rows if r["type"] == "meter")["samples"]
        counted = {
            name: [meter[-1]["links"][name][i] - meter[0]["links"][name][i] for i in (0, 1)]
            for name in ("stage0", "stage1")
        }
        payload = {
            d: sum(r["bytes"].get(f"boundary0.{d}.train", 0) for r in rows if r["type"] == "step")
            for d in ("forward", "backward")
        }
        assert payload["forward"] > 0 and payload["backward"] > 0
        # what each link's qdisc metered covers the payload that crossed it, headers on top
        assert counted["stage0"][0] > payload["forward"] and counted["stage1"][1] > payload["forward"]
        assert counted["stage1"][0] > payload["backward"] and counted["stage0"][1] > payload["backward"]
        assert all(later["at"] > earlier["at"] for earlier, later in zip(meter, meter[1:], strict=False))
    else:
        assert (
            "in-process shaping: bootstrap 50mbit, stage0 50mbit, stage1 20mbit, trainer 50mbit; delay 5ms"
            in out.stdout
        )
        probe = re.search(r"\[lab\] probe trainer<->stage1: up ([0-9.]+) Mbit/s, down ([0-9.]+) Mbit/s", out.stdout)
        assert (
            probe and 30 < float(probe[1]) <= 55 and 12 < float(probe[2]) <= 22
        )  # up: the trainer's 50mbit shaper, down: stage1's 20mbit
    meter = next(r for r in read_results(results) if r["type"] == "meter")["samples"]
    used = {
        name: [meter[-1]["cpu"][name][i] - meter[0]["cpu"][name][i] for i in (0, 1)]
        for name in ("stage0", "stage1", "trainer")
    }
    assert all(own > 0 and daemon > 0 for own, daemon in used.values()), (
        used
    )  # each peer and its p2p daemon worked while metered
    cfg = load_config(SMOKE, ["train.eval_every=100", "model.num_stages=2"])
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))


def test_in_process_shaping_paces_every_payload_a_peer_sends(swarm):
    """Peers created with a shape rate send requests and replies through their token bucket."""
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    shaped = [
        swarm.loop.run(SwarmNode.create(swarm.options(shape_rate="200mbit", shape_delay="1ms", client_mode=client)))
        for client in (False, False, True)
    ]
    servers = [StageServer(node) for node in shaped[:2]]
    try:
        for stage, server in enumerate(servers):
            swarm.loop.run(server.start())
            server.host(HostedStage(server.node, run_id, cfg, stage))
            swarm.loop.run(server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = SwarmPipeline(shaped[2], swarm.loop, cfg, run_id)
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
        for server in servers:
            swarm.loop.run(server.stop())
        for node in shaped:
            swarm.loop.run(node.shutdown())
