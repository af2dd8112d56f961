"""Throughput bounds (swarm.bench.bounds): the busiest link, the slowest stage, the shared cores."""

from __future__ import annotations

import math

import pytest

from swarm.bench import bounds


def test_compute_bound_and_fraction():
    assert bounds.compute_bound([0.1, 0.25, 0.2]) == pytest.approx(4.0)
    assert bounds.fraction_of_bound(3.0, link_bound=10.0, compute_bound=4.0) == pytest.approx(0.75)
    assert bounds.fraction_of_bound(3.0, link_bound=5.0) == pytest.approx(0.6)
    assert math.isnan(bounds.fraction_of_bound(1.0, math.inf))
    with pytest.raises(ValueError):
        bounds.compute_bound([])
    assert bounds.shared_cores_bound(2, [0.01, 0.03]) == pytest.approx(50.0)  # two cores, 40 ms of CPU per sample
    assert bounds.shared_cores_bound(2, [0.0]) == math.inf
    with pytest.raises(ValueError, match="cores"):
        bounds.shared_cores_bound(0, [0.01])
    fw, bw = [1e6, 1e6, 1e6], [1e6, 1e6, 1e6]
    assert bounds.pipeline_bound("80mbit", fw, bw, stage_seconds=[0.01, 0.02, 0.01, 0.01]).compute == pytest.approx(50)
    assert bounds.pipeline_bound("80mbit", fw, bw).compute == math.inf  # stage times unknown


def test_access_links_are_full_duplex_but_a_middle_stage_sends_both_waves():
    """In the namespace lab each direction of a process's link has the whole rate, but a middle
    stage's up link carries activations forward AND gradients back."""
    fw, bw = [1e6, 1e6, 1e6], [1e6, 1e6, 1e6]
    loads = bounds.access_loads(bounds.chain_transfers(fw, bw))
    assert loads["stage0"] == bounds.Load(up=1e6, down=1e6)
    assert loads["stage1"] == bounds.Load(up=2e6, down=2e6)
    b = bounds.pipeline_bound("80mbit", fw, bw)  # 10 MB/s over 2 MB per sample
    assert b.link == pytest.approx(5.0) and b.busiest in ("stage1", "stage2") and b.wire_bytes == 2e6
    two = bounds.pipeline_bound(80e6, [1e6], [0.5e6])  # full duplex: forward and backward do not add up
    assert two.link == pytest.approx(10.0) and (two.busiest, two.direction) == ("stage0", "up")
    slow_edge = bounds.pipeline_bound({"stage0": "8mbit", "stage1": None}, fw, bw)
    assert slow_edge.busiest == "stage0" and slow_edge.link == pytest.approx(1.0)
    with_trainer = bounds.chain_transfers(fw, bw, input_bytes=3e6)
    assert bounds.access_loads(with_trainer)["trainer"].up == pytest.approx(3e6)
    # stage 0 receives the inputs and the gradients
    assert bounds.access_bound("80mbit", with_trainer) == (pytest.approx(2.5), "stage0", "down")
    assert bounds.pipeline_bound(80e6, [0.0], [0.0]).link == math.inf  # nothing crosses a link
    with pytest.raises(ValueError, match="stage names"):
        bounds.chain_transfers(fw, bw, names=["a", "b"])
