"""The parts the swarm's metrics and health page are made of, without a network: events, busy
time, the trainer's status record read as untrusted data, and the page's data from survey rows."""

from __future__ import annotations

import math

import pytest

from swarm.transport.hivemind.dht.runstatus import RunStatus
from swarm.transport.hivemind.dht.survey import Announcement, PeerRow, Reach, Work
from swarm.transport.hivemind.flow.busy import Busy
from swarm.transport.hivemind.monitor.health import health_data
from swarm.transport.hivemind.net.events import KEEP, KINDS, TEXT_CHARS, Event, EventLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_event_log_keeps_the_newest_counts_all_and_says_one_line():
    log = EventLog(keep=3, clock=Clock())
    for i in range(5):
        log.add("join", f"peer {i}\njoined")
    log.add("ban", "x" * 1000)
    assert [e.text for e in log.last()] == ["peer 3 joined", "peer 4 joined", "x" * (TEXT_CHARS - 3) + "..."]
    assert +log.counts == {"join": 5, "ban": 1} and log.counts["pause"] == 0 and set(log.counts) == set(KINDS)
    assert len(log.last(1)) == 1 and log.last(0) == []
    with pytest.raises(ValueError, match="unknown event kind"):
        log.add("explode", "no")


@pytest.mark.parametrize(
    "item",
    [("soon", "join", "x"), (float("nan"), "join", "x"), (1.0, 3, "x"), (1.0, "join", None), (True, "join", "x")],
)
def test_an_event_from_another_peer_must_be_well_formed(item):
    assert Event.of(*item) is None


def test_an_unknown_kind_from_another_peer_is_other():
    assert Event.of(5, "rm -rf", "a\tb").kind == "other"
    assert Event.of(5, "rm -rf", "a\tb").text == "a b"


def test_overlapping_activities_count_their_common_time_once():
    clock = Clock()
    busy = Busy(clock)
    busy.enter()  # 100
    clock.now = 101
    busy.enter()
    clock.now = 103
    busy.leave()
    assert busy.seconds == 3.0  # still busy: the one going on counts so far
    clock.now = 104
    busy.leave()
    clock.now = 110  # idle
    with busy.during():
        clock.now = 112
    assert busy.seconds == 6.0


def test_a_status_record_round_trips_and_garbage_is_dropped_or_bounded():
    events = [Event(1.0 + i, "join", f"e{i}") for i in range(KEEP + 10)]
    status = RunStatus(
        step=7,
        total_steps=9,
        loss=0.5,
        samples_per_s=3.0,
        eta_s=4.0,
        state="training",
        members={0: 2, 1: 1},
        events=events,
        trainer="t",
        updated=5.0,
    )
    back = RunStatus.from_value(status.to_value(), "owner")
    assert (back.step, back.total_steps, back.loss, back.members, back.owner) == (7, 9, 0.5, {0: 2, 1: 1}, "owner")
    assert [e.text for e in back.events] == [f"e{i}" for i in range(10, KEEP + 10)]  # the newest KEEP
    for bad in (
        None,
        [],
        {"step": "7", "updated": 1.0},
        {"step": -1, "updated": 1.0},
        {"step": 1, "updated": math.inf},
    ):
        assert RunStatus.from_value(bad, "o") is None
    hostile = {
        "step": 1,
        "updated": 2.0,
        "loss": "NaN",
        "samples_per_s": -5,
        "state": "a\n" * 500,
        "members": {"0": 1, "x": 2, "1": "many"},
        "events": [[1, "join", "ok"], "nope", [1, 2], [float("inf"), "ban", "no"]],
    }
    read = RunStatus.from_value(hostile, "o")
    assert read.loss is None and read.samples_per_s == 0.0 and len(read.state) <= 200 and "\n" not in read.state
    assert read.members == {0: 1} and [e.text for e in read.events] == ["ok"]


def _row(stage: int, peer: str, links: list[dict], **fields) -> PeerRow:
    announced = Announcement([f"/ip4/1.2.3.{stage}/tcp/1"], 10.0, 0, True, 1.0)
    return PeerRow("run", stage, 3, peer, announced, Reach(reachable=True), Work(links=links), **fields)


def _link(neighbour, boundary, upstream, sent, raw, busy_s=0.0, busy_bytes=0):
    return {
        "neighbour": neighbour,
        "boundary": boundary,
        "upstream": upstream,
        "sent": sent,
        "received": {},
        "raw": raw,
        "busy_s": busy_s,
        "busy_bytes": busy_bytes,
    }


def test_the_page_data_joins_both_ends_of_a_link_and_shows_an_empty_stage():
    rows = [
        # A sends activations (compressed 4x) to B and hears gradients arrive at 2 Mbit/s
        _row(
            0,
            "A",
            [_link("B", 0, True, {"forward.train": 100, "forward.eval": 20}, {"forward.train": 480}, 1.0, 250_000)],
        ),
        # B sends gradients (2x) back and hears activations arrive at 8 Mbit/s
        _row(
            1,
            "B",
            [_link("A", 0, False, {"backward.train": 50}, {"backward.train": 100}, 0.5, 500_000)],
            events=[Event(90.0, "join", "b joined")],
        ),
    ]
    status = RunStatus(step=3, state="training", events=[Event(95.0, "pause", "paused")], updated=99.0)
    data = health_data(rows, {"run": 3}, {"run": ("owner", status)}, now=100.0, dht_now=100.0)
    (run,) = data["runs"]
    assert [[p["peer_id"] for p in s["peers"]] for s in run["stages"]] == [["A"], ["B"], []]
    (link,) = run["links"]
    assert (link["boundary"], link["from"], link["to"]) == (0, "A", "B")
    assert link["forward"] == {"mbit_s": 8.0, "ratio": 4.0, "bytes": 120}
    assert link["backward"] == {"mbit_s": 2.0, "ratio": 2.0, "bytes": 50}
    assert [(e["source"], e["kind"], e["age_s"]) for e in run["events"]] == [
        ("trainer", "pause", 5.0),
        ("stage 1 peer ...B", "join", 10.0),
    ]
    assert run["progress"]["step"] == 3 and run["progress"]["age_s"] == 1.0 and run["owner"] == "owner"


def test_the_page_data_of_a_run_without_a_trainer_record_or_peers():
    data = health_data([], {"lonely": 2}, {}, now=1.0, dht_now=1.0)
    assert data["runs"] == [
        {
            "run_id": "lonely",
            "num_stages": 2,
            "owner": "",
            "progress": None,
            "stages": [{"stage": 0, "peers": []}, {"stage": 1, "peers": []}],
            "links": [],
            "events": [],
        }
    ]


def test_the_page_server_serves_the_page_its_latest_data_as_strict_json_and_nothing_else():
    import json
    import urllib.error
    import urllib.request

    from swarm.transport.hivemind.monitor.page import HealthServer

    server = HealthServer(0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        page = urllib.request.urlopen(base + "/", timeout=10)
        assert page.headers["Content-Type"].startswith("text/html") and b"data.json" in page.read()
        assert json.loads(urllib.request.urlopen(base + "/data.json", timeout=10).read())["runs"] == []
        # a peer that reported NaN or infinity: null on the page, never a bare NaN its parser refuses
        server.update({"generated": 1.0, "runs": [{"throughput": float("nan"), "eta": [float("inf"), 2.0]}]})
        text = urllib.request.urlopen(base + "/data.json?x=1", timeout=10).read().decode()
        assert json.loads(text)["runs"] == [{"throughput": None, "eta": [None, 2.0]}] and "NaN" not in text
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(base + "/../etc/passwd", timeout=10)
        assert missing.value.code == 404
    finally:
        server.close()


@pytest.mark.parametrize(
    "change",
    [
        {"throughput": float("nan")},
        {"throughput": float("inf")},
        {"num_stages": 10**9},
        {"stage": 5},
        {"updated": float("nan")},
        {"queue": float("inf")},
    ],
)
def test_a_stage_record_with_absurd_numbers_is_dropped(change):
    from swarm.transport.hivemind.dht.announce import StageRecord

    good = {"stage": 1, "num_stages": 3, "addrs": [], "throughput": 2.0, "queue": 1, "updated": 5.0}
    assert StageRecord.from_value("peer", good) is not None
    assert StageRecord.from_value("peer", {**good, **change}) is None
