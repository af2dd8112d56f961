"""The adaptive compression policy (swarm.compression.adaptive): the mildest setting that fits, with hysteresis."""

from __future__ import annotations

import pytest

from swarm.compression import adaptive
from swarm.rates import parse_rate


def test_adaptive_picks_mildest_that_fits_and_follows_a_bandwidth_drop():
    elements = 250_000  # 1 MB of fp32 activations per sample
    options = adaptive.topk_candidates(elements)
    assert [c.spec for c in options] == ["none", "topk:0.5", "topk:0.3", "topk:0.2", "topk:0.1", "topk:0.05"]
    ctl = adaptive.AdaptiveCompression({0: options, 1: adaptive.quant_candidates(elements)}, hysteresis=0.15)
    targets = adaptive.neighbour_targets([0.05, 0.1, 0.08])
    assert targets == {0: 0.1, 1: 0.1}

    first = ctl.decide(1e9, targets)  # 1 Gbit/s: 1 MB takes 8 ms, no compression needed
    assert ctl.choices == {0: "none", 1: "none"} and all(d.fits and d.changed for d in first.values())

    drop = ctl.decide({0: 40e6, 1: 40e6}, targets)  # 40 Mbit/s: 100 ms carries 500 kB
    assert ctl.choices == {0: "topk:0.3", 1: "quant:8"}  # topk:0.5 needs 106 ms; quant:8 needs 50 ms
    assert all(d.fits and d.changed for d in drop.values())

    worse = ctl.decide(4e6, targets)  # nothing fits at 4 Mbit/s: the strongest, flagged
    assert ctl.choices == {0: "topk:0.05", 1: "quant:2"} and not worse[0].fits

    # recovery with jitter around the threshold where topk:0.3 fits (it needs 73 Mbit/s... after the drop)
    ctl.decide(40e6, targets)
    assert ctl.choices[0] == "topk:0.3"
    changes = len(ctl.history)
    for bandwidth in (42.8e6, 42.0e6, 42.8e6, 42.0e6):  # topk:0.5 would fit at >= 42.5 Mbit/s, but not with 15% spare
        ctl.decide(bandwidth, targets)
        assert ctl.choices[0] == "topk:0.3"
    assert len([d for d in ctl.history[changes:] if d.boundary == 0]) == 0  # no flapping
    ctl.decide(60e6, targets)  # comfortably enough: relax
    assert ctl.choices[0] == "topk:0.5"
    assert "boundary 0: topk:0.5" in ctl.report()


def test_adaptive_compression_follows_a_bandwidth_drop_and_recovers_with_hysteresis():
    elements = 64 * 32 * 32  # ResNet-18 layer1, per sample
    ctl = adaptive.AdaptiveCompression({0: adaptive.topk_candidates(elements)}, hysteresis=0.15)
    target = 0.008  # seconds of link time per sample the compute allows
    assert ctl.decide(parse_rate("1gbit"), target)[0].spec in ("none", "topk:1.0")  # fast: no compression
    dropped = ctl.decide(parse_rate("20mbit"), target)[0]
    assert dropped.changed and dropped.spec.startswith("topk:") and dropped.link_seconds <= target
    milder = [c.spec for c in ctl.candidates[0]].index(dropped.spec) - 1
    assert milder >= 0  # a milder setting exists, and it does not fit at 20 Mbit/s
    assert ctl.candidates[0][milder].link_seconds(parse_rate("20mbit")) > target
    assert not ctl.decide(parse_rate("21mbit"), target)[0].changed  # a small recovery does not flap back
    assert ctl.decide(parse_rate("1gbit"), target)[0].index == 0
    assert len(ctl.history) == 3 and "change(s)" in ctl.report()


def test_adaptive_rejects_misordered_candidates():
    with pytest.raises(ValueError, match="mildest"):
        adaptive.AdaptiveCompression({0: [adaptive.Candidate("topk:0.1", 10), adaptive.Candidate("none", 100)]})
    assert adaptive.choose([adaptive.Candidate("a", 1000), adaptive.Candidate("b", 10)], 8000, 0.5) == 1
