"""Adaptive compression in a running swarm (real hivemind on loopback, in-process egress shaping).

Stage 0's host is shaped: what it sends is boundary 0's activations (its replies go to the
trainer, not over a boundary), so boundary 0's forward direction is the slow link.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from _swarm_env import SMOKE
from _util import frame

from protocols import stage_pb2 as pb
from protocols.framing import ProtocolError, parse_message
from protocols.stubs import STUBS
from swarm.config import ConfigError, load_config
from swarm.training.checkpoints import Checkpointing
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.flow.meter import LinkMeter, timed_chunks
from swarm.transport.hivemind.stage.codecs import switched_config
from swarm.transport.hivemind.stage.host import HostedStage, config_digest
from swarm.transport.hivemind.trainer.adaptive import AdaptiveCodecs

TARGET_MS = 5  # boundary 0 carries 2 kB per sample uncompressed: 16 ms at 1 Mbit/s, well under 1 ms on loopback


def adaptive_cfg(*overrides: str):
    return load_config(
        SMOKE,
        [
            "compression.forward=none",
            "compression.backward=none",
            "compression.adaptive.ladder=topk",
            f"compression.adaptive.target_ms={TARGET_MS}",
            "train.eval_every=100",
            "train.eval_compressed=false",
            "data.options.train_size=1750",  # a small final evaluation over the slow link: all 47 left
            "data.options.test_subset=null",
            *overrides,
        ],
    )


class Hook(ResultsWriter):
    """Results in memory; calls `after(step)` once a step's row is written (between two steps)."""

    def __init__(self, after=None) -> None:
        super().__init__(None)
        self.after = after

    def write(self, row: dict) -> None:
        super().write(row)
        if row.get("type") == "step" and self.after is not None:
            self.after(row["step"])


@dataclass(frozen=True)
class Hooks:
    """What a shaped run calls: `after(step, egress)` after each step, `finish(run_id, data, hosted)`
    before the stages go; its checkpointing."""

    after: Callable | None = None
    finish: Callable | None = None
    checkpoint: Checkpointing | None = None


def shaped_run(swarm, cfg, steps: int, rate: str, placement=((1, 1), (2, 2), (3, 3)), hooks: Hooks = Hooks()):
    """Trains `steps` steps with stage 0 on a host whose egress runs at `rate` and the other stages
    on `placement`; returns (rows, summary, statuses at the end, the trainer's adaptive
    controller, swarm warnings, the hosted stages of `placement`); `finish(run_id, data, hosted)`
    runs before the stages go."""
    run_id = uuid.uuid4().hex[:8]
    node, server = swarm.mortal_host(shape_rate=rate)
    server.host(HostedStage(node, run_id, cfg, 0))
    swarm.loop.run(server.announcer.announce_now())
    hosted = swarm.host(cfg, run_id, list(placement))
    warnings: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = warnings.append
    logging.getLogger("swarm").addHandler(catcher)
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, steps, data)
        results = Hook(None if hooks.after is None else lambda step: hooks.after(step, node.egress))
        summary = train(cfg, pipeline, data, results, steps, progress=False, checkpoint=hooks.checkpoint)
        statuses = pipeline.statuses()
        if hooks.finish is not None:
            hooks.finish(run_id, data, hosted)
    finally:
        logging.getLogger("swarm").removeHandler(catcher)
        swarm.unhost(run_id)
        swarm.loop.run(server.stop())
        swarm.loop.run(node.shutdown())
    return results.rows, summary, statuses, pipeline.adaptive, warnings, hosted


def link_codecs(statuses, boundary: int) -> set[tuple[bool, str, str]]:
    """(upstream end?, forward, backward) of every peer's end of `boundary` in use (a link whose
    ends went in a switch and has carried nothing since has none)."""
    return {
        (link.upstream, link.forward_codec, link.backward_codec)
        for s in statuses
        for link in s.links
        if link.boundary == boundary and link.forward_codec
    }


def test_a_slow_link_gets_a_stronger_setting_from_the_first_decision(swarm):
    cfg = adaptive_cfg("compression.adaptive.ladder=quant")
    replicated = ((1, 1), (1, 4), (2, 2), (3, 3))  # two peers serve stage 1
    restarted = []

    def new_session(
        run_id: str, data, hosted
    ) -> None:  # a new trainer: the stages start from the config's codecs again
        switched = [h.state.cfg.compression.link(0) for h in hosted[:2]]
        swarm.pipeline(cfg, run_id, 3, data)
        restarted.extend([switched, [h.state.cfg.compression.link(0) for h in hosted[:2]]])  # stage 1's replicas

    rows, summary, statuses, adaptive, warnings, hosted = shaped_run(
        swarm, cfg, 3, "1mbit", placement=replicated, hooks=Hooks(finish=new_session)
    )
    steps = [r for r in rows if r["type"] == "step"]
    assert len(steps) == 3 and all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e6 for r in steps)  # finished, finite
    assert steps[0]["codecs"] == {
        "0": "none / none",
        "1": "none / none",
        "2": "none / none",
    }  # step 1 ran with the config's codecs
    chosen = steps[1]["codecs"]["0"]
    forward, backward = chosen.split(" / ")
    assert forward.startswith("quant:") and backward == forward  # none cannot fit: quantized both ways
    assert steps[1]["bytes"]["boundary0.forward.train"] < steps[0]["bytes"]["boundary0.forward.train"] / 2
    assert steps[1]["codecs"]["2"] == "none / none"  # 130 B per sample on an unshaped link: fits uncompressed
    changes = summary["adaptive"]["changes"]
    first = next(c for c in changes if c["boundary"] == 0)
    # moved from the codec in force
    assert (
        first["step"] == 1
        and first["from_step"] == 2
        and first["forward"] == forward
        and "none no longer fits" in first["why"]
    )
    assert summary["adaptive"]["codecs"] == steps[-1]["codecs"]
    assert "boundary 0" in summary["adaptive"]["decisions"]["0"] and "boundary 0" in adaptive.report()
    assert not warnings, [w.getMessage() for w in warnings]
    # the peers run boundary 0's new codecs on both of its ends, and both replicas of stage 1 switched
    assert link_codecs(statuses, 0) == {(up, *adaptive.codecs[0]) for up in (True, False)}
    switched, fresh = restarted
    assert [(link.forward, link.backward) for link in switched] == [adaptive.codecs[0]] * 2
    assert [link.forward for link in fresh] == ["none", "none"]
    # as configured: a switch does not change what setup checks
    assert all(h.place.digest == config_digest(cfg) for h in hosted)


DECIDED = 4  # the decision after step 4 sees the drop (every step, or every second: after step 2)


ASYNC = ("train.schedule=async", "compression.adaptive.every=2")


@pytest.mark.parametrize(
    "schedule", [(), ASYNC, (*ASYNC, "train.delay_correction=dc:10")], ids=["sync", "async", "async-dc"]
)
def test_a_bandwidth_drop_moves_a_boundary_to_stronger_compression_on_both_ends(swarm, monkeypatch, schedule):
    """Asynchronous too, deciding every second step: the pipeline drains after a step whose
    decision is due (the steps after the others start early), and the changes go with the apply
    round of the step before (trainer.closing `switch`; with dc that step was applied already)."""
    import swarm.transport.hivemind.trainer.membership as membership_module

    asked = []  # status calls, as the trainer makes them
    real_ask = membership_module.ask

    async def counted_ask(streams, peer_id, request, *args, **kwargs):
        if request.stub is STUBS.info:
            asked.append(peer_id)
        return await real_ask(streams, peer_id, request, *args, **kwargs)

    monkeypatch.setattr(membership_module, "ask", counted_ask)
    asked_by_step = []

    def drop(step: int, egress) -> None:
        asked_by_step.append(len(asked))
        if step == drop_after:
            egress.set_rate("1mbit")

    cfg = adaptive_cfg(*schedule)
    drop_after = DECIDED - cfg.compression.adaptive.every
    rows, summary, statuses, adaptive, warnings, _ = shaped_run(swarm, cfg, 7, "10gbit", hooks=Hooks(after=drop))
    # one status round per step (4 peers) serves both the decision and the step's byte counts
    assert [b - a for a, b in zip(asked_by_step, asked_by_step[1:], strict=False)] == [4] * 6
    steps = [r for r in rows if r["type"] == "step"]
    assert len(steps) == 7 and all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e6 for r in steps)
    # fast until the drop, and the step it hit
    assert all(r["codecs"]["0"] == "none / none" for r in steps[:DECIDED])
    switch = next(c for c in summary["adaptive"]["changes"] if c["boundary"] == 0)
    assert switch["step"] == DECIDED and "no longer fits" in switch["why"]
    assert switch["forward"].startswith("topk:") and switch["backward"] == "topk:reuse"
    after = steps[DECIDED]
    assert after["codecs"]["0"] == f"{switch['forward']} / topk:reuse"
    # topk:0.5 sends 53%: three steps after the switch against the first three (summed: an
    # asynchronous step's row may count bytes of the next step, started early)
    sent = [r["bytes"].get("boundary0.forward.train", 0) for r in steps]
    assert sum(sent[DECIDED:]) < 0.6 * sum(sent[:3])
    assert all(r["codecs"]["2"] == "none / none" for r in steps)
    # no micro-batch failed or was retried (a link whose ends disagreed would be reset): both ends switched together
    assert not warnings, [w.getMessage() for w in warnings]
    assert link_codecs(statuses, 0) == {(up, *adaptive.codecs[0]) for up in (True, False)}
    assert sum(s.processed for s in statuses if s.stage == 3) >= 7 * 4  # every training micro-batch went through
    if schedule:  # after steps 1, 3 and 5 the next step started early; after 2, 4 and 6 it did not
        assert summary["overlapped_steps"] == 3, summary


def test_a_resumed_run_keeps_the_codecs_its_checkpoint_was_saved_with(swarm, tmp_path):
    cfg = adaptive_cfg("compression.adaptive.ladder=quant")
    directory = tmp_path / "ck"
    resumed = []

    def resume(run_id: str, data, hosted) -> None:  # a new trainer session from the step-2 checkpoint, one step more
        results = Hook()
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        assert [h.state.cfg.compression.link(0).forward for h in hosted[:1]] == [
            "none"
        ]  # the new session reset the stages
        train(cfg, pipeline, data, results, 3, progress=False, checkpoint=Checkpointing(str(directory), 2))
        resumed.extend(
            [results.rows, pipeline.statuses(), [h.state.cfg.compression.link(0) for h in hosted], pipeline.adaptive]
        )

    rows, _, _, adaptive, warnings, _ = shaped_run(
        swarm, cfg, 2, "1mbit", hooks=Hooks(finish=resume, checkpoint=Checkpointing(str(directory), 2))
    )
    ran = [r for r in rows if r["type"] == "step"][-1]["codecs"]  # what step 2 ran with
    # what the checkpoint keeps: the codecs in force after step 2, those step 2 ran with unless the
    # decision after it moved them (on this machine's load it may: the link is timed)
    saved = "{} / {}".format(*adaptive.codecs[0])
    assert ran["0"].startswith("quant:") and saved.startswith("quant:")
    after_rows, statuses, stage_links, restored = resumed
    steps = [r for r in after_rows if r["type"] == "step"]
    assert [r["step"] for r in steps] == [3] and steps[0]["loss"] == steps[0]["loss"]  # resumed at step 2, ran step 3
    assert steps[0]["codecs"]["0"] == saved  # the loaded links ran the saved codecs, not the config's
    # after step 3 the resumed controller decides afresh (on this machine's load: it may move), and
    # both ends of the link follow it together, as the trainer sees it
    assert [(link.forward, link.backward) for link in stage_links[:1]] == [restored.codecs[0]]  # stage 1's peer
    assert link_codecs(statuses, 0) == {(up, *restored.codecs[0]) for up in (True, False)}
    assert restored.history[: len(adaptive.history)] == adaptive.history
    assert not warnings, [w.getMessage() for w in warnings]  # no link reset: both ends loaded the same codecs


def test_an_adaptive_checkpoint_is_refused_without_adaptive_compression(tmp_path):
    from swarm.engine.checkpoint import CODECS_FILE, checkpoint_codecs
    from swarm.transport.local import LocalPipeline

    (tmp_path / CODECS_FILE).write_text('{"codecs": {"0": ["quant:4", "quant:4"]}, "history": []}')
    assert checkpoint_codecs(tmp_path) == {"codecs": {0: ("quant:4", "quant:4")}, "history": []}
    with pytest.raises(ValueError, match="saved by a swarm with compression.adaptive"):
        LocalPipeline.load_checkpoint(None, tmp_path)
    (tmp_path / CODECS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable adaptive.json"):
        checkpoint_codecs(tmp_path)
    assert checkpoint_codecs(tmp_path / "elsewhere") is None


BAD_ADAPTIVE = [
    ("compression.adaptive.ladder=zip", "compression.adaptive.ladder: Input should be 'topk' or 'quant'"),
    ("compression.adaptive.every=0", "compression.adaptive.every"),
    ("compression.adaptive.hysteresis=1.5", "compression.adaptive.hysteresis"),
    ("compression.adaptive.target_ms=0", "compression.adaptive.target_ms"),
    ("compression.adaptive.window=3", "compression.adaptive.window"),
    ("model.num_stages=1", "1-stage model has no links"),
]


@pytest.mark.parametrize(("override", "message"), BAD_ADAPTIVE, ids=[o for o, _ in BAD_ADAPTIVE])
def test_bad_adaptive_configs_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        adaptive_cfg(override)


def test_adaptive_is_off_by_default_and_refused_in_one_process(tmp_path, capsys):
    # off by default
    assert adaptive_cfg().compression.adaptive.every == 1 and load_config(SMOKE).compression.adaptive is None
    with pytest.raises(ValueError, match="compression.adaptive needs the swarm"):
        run_experiment(adaptive_cfg(), tmp_path / "r.jsonl", 1, progress=False)
    from swarm.cli import main

    assert main(["run", str(SMOKE), "--steps", "1", "--set", "compression.adaptive.ladder=quant"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: compression.adaptive needs the swarm") and "\n" not in err


def test_link_meter_counts_overlapping_transfers_once():
    meter = LinkMeter()
    meter.add(0.0, 1.0, 100)
    meter.add(0.5, 1.5, 100)  # overlaps the first: only 0.5 s more
    meter.add(3.0, 4.0, 200)  # after an idle gap: the gap is not busy time
    assert meter.nbytes == 400 and meter.busy_s == pytest.approx(2.5)


async def _drain(messages):
    return [m async for m in messages]


def test_replies_are_timed_from_their_first_chunk_to_their_last():
    async def replies():
        for payload in (bytes(2_500_000), bytes((1 << 20) + 5), b"small"):  # three chunks, two, one
            for message in frame(pb.StageReply, "micro_batch", pb.ResultHead(kind=pb.BACKWARD), payload):
                yield message

    async def received():  # as a stream gives them: the chunks' data apart, as views
        async for message in replies():
            yield parse_message(pb.StageReply, message.SerializeToString())

    for source in (replies, received):
        ticks = iter(range(100))
        meter = LinkMeter()
        got = asyncio.run(_drain(timed_chunks(source(), meter, clock=lambda ticks=ticks: float(next(ticks)))))
        assert len(got) == 6
        # chunks 2 and 3 arrived over 2 ticks after the first; the two-chunk reply (a last chunk of 5
        # bytes) and the one-chunk reply are not timed
        assert meter.nbytes == 2_500_000 - (1 << 20) and meter.busy_s == 2.0
    assert [len(item.data) for item in got] == [
        1 << 20,
        1 << 20,
        2_500_000 - (2 << 20),
        1 << 20,
        5,
        5,
    ]  # passed on whole


def _status(stage: int, compute_s: float, samples: int, links: list[pb.LinkStatus]) -> pb.StageStatus:
    return pb.StageStatus(stage=stage, num_stages=2, compute_s=compute_s, samples=samples, links=links)


QUANT_LADDER_10MS = [
    "model.num_stages=2",
    "compression.forward=none",
    "compression.backward=none",
    "compression.adaptive.ladder=quant",
    "compression.adaptive.target_ms=10",
]


def statuses(forward_bits: float, backward_bits: float | None, elements: int = 1000) -> list[pb.StageStatus]:
    """Two stages' statuses after 100 samples of `elements` fp32 values (4000 B per sample
    uncompressed; quant:B sends 125 * B + 8) timed at these rates."""
    up = pb.LinkStatus(boundary=0, upstream=True, raw={"forward.train": 4 * elements * 100})
    if backward_bits is not None:  # gradients timed arriving back at stage 0
        up.busy_bytes, up.busy_s = 1_000_000, 8e6 / backward_bits
    down = pb.LinkStatus(boundary=0, upstream=False, busy_bytes=1_000_000, busy_s=8e6 / forward_bits)
    return [_status(0, 0.1, 100, [up]), _status(1, 0.1, 100, [down])]


def test_the_trainer_plans_with_each_direction_s_own_bandwidth():
    cfg = load_config(SMOKE, QUANT_LADDER_10MS)
    one_way = AdaptiveCodecs(cfg)
    assert one_way.observe(statuses(100e6, None), 1) == {}  # 100 Mbit/s both ways (backward assumed as fast): none fits
    assert one_way.bandwidth(0) == (pytest.approx(100e6), pytest.approx(100e6))
    slow_back = AdaptiveCodecs(cfg)
    changes = slow_back.observe(statuses(100e6, 0.5e6), 1)  # gradients come back at 0.5 Mbit/s: 64 ms uncompressed
    assert changes == {0: ("quant:4", "quant:4")}  # 8.1 ms; quant:5 needs 10.1 ms (the target is 10)
    assert "100mbit forward, 500kbit backward" in slow_back.last[0].describe()


def test_a_resumed_run_keeps_the_hysteresis_of_the_codecs_in_force():
    """At 550 kbit/s quant:5 fits the 10 ms target (9.2 ms) but not with 15% to spare; quant:4 (7.4 ms) does."""
    cfg = load_config(SMOKE, QUANT_LADDER_10MS)
    fresh = AdaptiveCodecs(cfg)
    assert fresh.observe(statuses(0.55e6, 0.55e6), 1) == {0: ("quant:5", "quant:5")}  # from none: the mildest that fits
    resumed = AdaptiveCodecs(cfg)
    resumed.restore({"codecs": {0: ("quant:4", "quant:4")}, "history": []})
    # quant:4 stays: a checkpoint does not reset the hysteresis
    assert resumed.observe(statuses(0.55e6, 0.55e6), 1) == {}
    assert "kept" in resumed.last[0].describe()


def test_stages_check_switched_codecs_before_the_step_applies():
    cfg = load_config(SMOKE, ["compression.forward=none", "compression.backward=none"])
    switched, changed = switched_config(
        cfg, 1, [pb.BoundaryCodecs(boundary=b, forward="quant:4", backward="quant:4") for b in (0, 1, 2)]
    )
    assert changed == [0, 1]  # stage 1 sits on boundaries 0 and 1 only
    assert switched.compression.link(1).forward == "quant:4" and switched.compression.link(2).forward == "none"
    # no change, no restart
    assert switched_config(switched, 1, [pb.BoundaryCodecs(boundary=0, forward="quant:4", backward="quant:4")])[1] == []
    with pytest.raises(ProtocolError, match="bad compression spec"):
        switched_config(cfg, 1, [pb.BoundaryCodecs(boundary=0, forward="zip:3", backward="none")])
    with pytest.raises(ProtocolError, match="topk:reuse needs a topk forward"):
        switched_config(cfg, 1, [pb.BoundaryCodecs(boundary=0, forward="quant:4", backward="topk:reuse")])
