"""Adaptive compression in a running swarm (real hivemind on loopback, in-process egress shaping)."""

from __future__ import annotations

import uuid

import pytest
from _swarm_env import SMOKE

from swarm.config import ConfigError, load_config
from swarm.netlab.shaper import TokenBucket
from swarm.results import ResultsWriter
from swarm.run import build_data, run_experiment, train

STEPS = 8
DROP_AFTER = 3


def adaptive_cfg(*overrides: str):
    return load_config(SMOKE, ["compression.forward=none", "compression.backward=none", "compression.adaptive.ladder=topk", "compression.adaptive.target_ms=2", "train.eval_every=100", *overrides])


class DropsBandwidth(ResultsWriter):
    """After step DROP_AFTER, the shaped host's egress falls to 1 Mbit/s (between two steps)."""

    def __init__(self, bucket: TokenBucket) -> None:
        super().__init__(None)
        self.bucket = bucket

    def write(self, row: dict) -> None:
        super().write(row)
        if row.get("type") == "step" and row["step"] == DROP_AFTER:
            self.bucket.set_rate("1mbit")


def test_a_bandwidth_drop_moves_a_boundary_to_stronger_compression_on_both_ends(swarm):
    cfg = adaptive_cfg()
    run_id = uuid.uuid4().hex[:8]
    node, servicer = swarm.mortal_host(shape_rate="10gbit")  # stage 1's host: what it sends is shaped
    hosted = swarm.host(cfg, run_id, [(0, 0), (2, 2), (3, 3)])
    from swarm.network.hosted import HostedStage

    hosted.insert(1, servicer.host(HostedStage(node, run_id, cfg, 1, timeout=30)))
    swarm.loop.run(servicer.announcer.announce_now())
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        results = DropsBandwidth(node.egress)
        summary = train(cfg, pipeline, data, results, STEPS, progress=False)
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(servicer.stop())
        swarm.loop.run(node.shutdown())
    steps = [r for r in results.rows if r["type"] == "step"]
    assert len(steps) == STEPS and all(r["loss"] == r["loss"] for r in steps)  # finished, finite
    before, after = steps[DROP_AFTER - 1], steps[-1]
    assert before["codecs"]["1"] == "none / none"  # fast link: no compression needed
    forward, backward = after["codecs"]["1"].split(" / ")
    assert forward.startswith("topk:") and backward == "topk:reuse"  # 1 Mbit/s: TopK
    # both ends of boundary 1 switched, and it carries far fewer bytes
    assert hosted[1].cfg.compression.link(1) == hosted[2].cfg.compression.link(1)
    assert hosted[1].cfg.compression.link(1).forward == forward
    assert after["bytes"]["boundary1.forward.train"] < before["bytes"]["boundary1.forward.train"] / 2
    assert after["codecs"]["0"] == "none / none"  # the untouched boundary keeps its codec
    changes = summary["adaptive"]
    assert {c["boundary"] for c in changes} == {1} and changes[0]["step"] > DROP_AFTER
    assert changes[0]["forward"].startswith("topk:") and "no longer fits" in changes[0]["why"]


def test_adaptive_config_errors_and_single_process_refusal(tmp_path):
    with pytest.raises(ConfigError, match="compression.adaptive.ladder"):
        adaptive_cfg("compression.adaptive.ladder=zip")
    with pytest.raises(ConfigError, match="compression.adaptive.every"):
        adaptive_cfg("compression.adaptive.every=0")
    with pytest.raises(ConfigError, match="compression.adaptive.hysteresis"):
        adaptive_cfg("compression.adaptive.hysteresis=1.5")
    with pytest.raises(ValueError, match="compression.adaptive needs the swarm"):
        run_experiment(adaptive_cfg(), tmp_path / "r.jsonl", 1, progress=False)


def test_link_meter_counts_overlapping_transfers_once():
    from swarm.network.meter import LinkMeter

    meter = LinkMeter()
    meter.add(0.0, 1.0, 100)
    meter.add(0.5, 1.5, 100)  # overlaps the first: only 0.5 s more
    meter.add(3.0, 4.0, 200)  # after an idle gap: the gap is not busy time
    assert meter.nbytes == 400 and meter.busy_s == pytest.approx(2.5)
