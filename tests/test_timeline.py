"""A process's timeline (swarm.tracing) and several merged into one (swarm.timeline)."""

from __future__ import annotations

import json

import pytest

from swarm import timeline
from swarm.tracing import Tracer


def _peer(process: str, peer_id: str, skew: float, exchanges, spans) -> dict:
    """A peer's written timeline whose clock reads `skew` seconds ahead of true time."""
    tracer = Tracer()
    tracer.start(process)
    for name, track, start, end in spans:
        tracer.add(name, track, start + skew, end + skew, mb="train/0/0")
    for role, peer, key, t0, t1 in exchanges:
        tracer.exchange(role, peer, key, t0 + skew, t1 + skew)
    return json.loads(json.dumps(tracer.trace(peer_id)))


def test_a_tracer_is_silent_until_started_and_writes_chrome_trace_events(tmp_path):
    tracer = Tracer()
    with tracer.span("forward", "compute"):
        pass
    tracer.exchange("caller", "P", "k", 1.0, 2.0)
    assert tracer.trace()["traceEvents"][1:] == [] and tracer.trace()["otherData"]["exchanges"] == []
    tracer.write(tmp_path / "off.json")
    assert not (tmp_path / "off.json").exists()
    tracer.start("stage1 ab12")
    with tracer.span("forward", "compute", mb="train/3/1"):
        pass
    tracer.add("send", "send to stage2 cd34", 10.0, 10.5, bytes=7)
    tracer.write(tmp_path / "on.json", "QmPeer")
    trace = json.loads((tmp_path / "on.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"]) for e in spans] == [("forward", "compute"), ("send", "send")]
    assert spans[1]["ts"] == 10e6 and spans[1]["dur"] == pytest.approx(0.5e6) and spans[1]["args"] == {"bytes": 7}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"stage1 ab12", "compute", "send to stage2 cd34"}
    assert trace["otherData"]["peer_id"] == "QmPeer"


def test_merging_aligns_clocks_from_the_exchanges_and_says_where_the_time_goes(tmp_path):
    # true times: the trainer sends at 0.0, it arrives at stage 0 at 0.05 (50 ms one way); stage 0
    # replies at 0.45, the reply arrives at 0.50. Stage 0's clock runs 7 s ahead, stage 1's 7 s + 2 ms.
    trainer = _peer(
        "trainer",
        "T",
        0.0,
        [("caller", "S0", "train/0/0/1/0", 0.0, 0.50)],
        [("micro-batches 0", "steps", 0.0, 0.6), ("step 0", "steps", 0.6, 0.7)]
        + [("micro-batches 1", "steps", 1.0, 1.6), ("step 1", "steps", 1.6, 1.7)]
        + [("micro-batches 2", "steps", 2.0, 2.6), ("step 2", "steps", 2.6, 2.7)],
    )
    stage0 = _peer(
        "stage0 S0xx",
        "S0",
        7.0,
        [("callee", "T", "train/0/0/1/0", 0.05, 0.45), ("caller", "S1", "train/0/0/1/0", 0.10, 0.40)],
        [("forward", "compute", 1.0, 1.3), ("send", "send to stage1 S1xx", 1.2, 1.7)],
    )
    stage1 = _peer(
        "stage1 S1xx",
        "S1",
        7.002,
        [("callee", "S0", "train/0/0/1/0", 0.15, 0.35)],
        [("backward", "compute", 1.5, 1.6)],
    )
    paths = []
    for trace in (stage1, trainer, stage0):
        paths.append(tmp_path / f"{trace['otherData']['process'].split()[0]}.json")
        paths[-1].write_text(json.dumps(trace))
    merged = timeline.merge([timeline.load(path) for path in paths])
    assert merged["otherData"]["processes"] == ["trainer", "stage0 S0xx", "stage1 S1xx"]
    assert merged["otherData"]["offsets_ms"] == pytest.approx({"trainer": 0, "stage0 S0xx": 7000, "stage1 S1xx": 7002})
    forward = next(e for e in merged["traceEvents"] if e.get("name") == "forward")
    assert forward["pid"] == 2 and forward["ts"] == pytest.approx(1.0e6)  # back on the trainer's clock
    lines = timeline.where_time_goes(merged)
    assert lines[0].startswith("over 1.70 s")  # the steady steps: the second to the last
    assert "compute 18%" in lines[2] and "send 29%" in lines[2]  # 0.3 s and 0.5 s of 1.7 s
    assert timeline.step_window(merged, 1) == pytest.approx((1.0, 1.7))
    timeline.plot(merged, tmp_path / "step.png", title="three peers")
    assert (tmp_path / "step.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="not a timeline a peer wrote"):
        (tmp_path / "junk.json").write_text("[]")
        timeline.load(tmp_path / "junk.json")


def test_step_marks_say_when_each_peer_s_part_of_a_steady_step_happens(tmp_path):
    trainer, stage0 = Tracer(), Tracer()
    trainer.start("trainer")
    stage0.start("stage0 S0xx")
    for k in range(4):  # four steps a second apart: the first is warm-up, the last has no next
        trainer.add(f"micro-batches {k}", "steps", k, k + 0.6)
        trainer.add(f"step {k}", "steps", k + 0.6, k + 0.7)
        stage0.add("receive", "receive from trainer T", k + 0.05, k + 0.06, bytes=320)
        stage0.add("forward", "compute", k + 0.06, k + 0.16)
        stage0.add("send", "send to stage1 S1xx", k + 0.2, k + 0.45 + 0.05 * (k == 2), bytes=250_000)
    merged = timeline.merge([trainer.trace("T"), stage0.trace("S0")])
    head, trainer_line, stage_line = timeline.step_marks(merged)
    assert head == "steps 2 steady, 1.000 (1.000-1.000) s each; seconds from a step's start:"
    assert "replies back 0.600 (0.600-0.600); its step 0.100 (0.100-0.100); to the next step 0.300" in trainer_line
    assert "first receive 0.050 (0.050-0.050); first send 0.200 (0.200-0.200)" in stage_line
    assert "last send done 0.475 (0.450-0.500)" in stage_line  # 250 kB in 0.25 s and in 0.3 s
    assert "Mbit/s while sending 7.3" in stage_line and "compute 0.100 (0.100-0.100)" in stage_line
    assert timeline.step_marks(timeline.merge([stage0.trace("S0")])) == [
        "no steady steps in this timeline (it needs 3 training steps or more)"
    ]


def test_a_timeline_without_spans_says_so_instead_of_idle_shares():
    trainer = Tracer()
    trainer.start("trainer")  # the run failed before its first step
    merged = timeline.merge([trainer.trace("T")])
    assert timeline.where_time_goes(merged) == [
        "no time to share out: the timeline has no span (the run ended before its first step?)"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "not a timeline a peer wrote"),
        ("[1, 2]", "not a timeline a peer wrote"),
        ('{"otherData": {"processes": 3}, "traceEvents": 4}', "its events do not read as a timeline's"),
        ('{"otherData": {"processes": []}, "traceEvents": [{"ph": "X"}]}', "its events do not read as a timeline's"),
    ],
)
def test_the_timeline_command_refuses_files_that_are_no_timeline_in_one_line(tmp_path, capsys, text, message):
    from _util import refusal

    (tmp_path / "t.json").write_text(text)
    assert message in refusal(capsys, "timeline", str(tmp_path / "t.json"))
