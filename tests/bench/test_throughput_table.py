"""The throughput benchmark's table: backward specs and speedups, the target lines, the setup
line, the JSON rows (and the committed ones) and the plot, and how many steps a point runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from swarm.bench.throughput import (
    MAX_STEPS,
    backward_spec,
    codec_overrides,
    describe_setup,
    expected_samples_per_s,
    steps_for,
)
from swarm.bench.throughput_figures import ThroughputRow
from swarm.bench.throughput_table import (
    format_rows,
    from_json,
    plot,
    speedups,
    target_lines,
    to_json,
)

DOCS = Path(__file__).parents[2] / "docs" / "bench"  # the committed figures


# a plain link-bound row: what each test's rows do not set
PLAIN = dict(
    backward="none",
    link_bound=1.0,
    compute_bound=math.inf,
    fraction_of_bound=1.0,
    schedule_bound=1.0,
    binding="link",
    busiest_bytes_per_sample=1.0,
    forward_bytes=[],
    backward_bytes=[],
    stage_ms_per_sample=[],
    steps=4,
    shaping="netns",
    samples_per_s=1.0,
)


def _row(**flat) -> ThroughputRow:
    """A row from its flat keys, as the benchmark's JSON holds them (PLAIN's for those not given)."""
    return ThroughputRow.from_json({**PLAIN, **flat})


def test_backward_specs_and_speedups():
    assert backward_spec("topk:0.1") == "topk:reuse"
    assert backward_spec("topk:0.1+ef21") == "topk:0.1+ef21"
    assert backward_spec("quant:4") == "quant:4"
    assert backward_spec("topk:0.1|quant:8") == "quant:8"
    assert codec_overrides("topk:0.1") == (
        "topk:0.1",
        "topk:reuse",
        ["compression.forward=topk:0.1", "compression.backward=topk:reuse"],
    )
    assert codec_overrides("adaptive:quant")[2][-1] == "compression.adaptive.ladder=quant"
    with pytest.raises(ValueError, match="adaptive:topk or adaptive:quant"):
        codec_overrides("adaptive:zip")
    rows = [
        _row(codec="none", bandwidth_mbit=100, samples_per_s=10),
        _row(codec="topk:0.1", bandwidth_mbit=100, samples_per_s=65),
    ]
    assert speedups(rows) == {("topk:0.1", 100): pytest.approx(6.5)}


def test_target_lines_tell_link_bound_points_from_compute_bound_ones():
    base = dict(compute_bound=1.0)
    rows = [
        _row(codec="none", bandwidth_mbit=10, fraction_of_bound=0.85, binding="link stage1 up", **base),
        _row(codec="none", bandwidth_mbit=500, fraction_of_bound=0.79, binding="link stage2 down", **base),
        _row(
            codec="quant:4",
            bandwidth_mbit=500,
            fraction_of_bound=0.6,
            binding="cores (2 shared)",
            compute_share=0.63,
            **base,
        ),
        _row(codec="topk:0.1", bandwidth_mbit=500, fraction_of_bound=math.nan, binding="compute", **base),
    ]
    lines = target_lines(rows, target=0.8)
    assert lines[0] == "link-bound points at >= 80% of the bound: 1 of 2 (lowest: none at 500 Mbit/s 79%)"
    assert (
        lines[1] == "bound by cores (2 shared): quant:4 at 500 Mbit/s 60%; the stages' compute used 63% of the busy CPU"
    )
    assert len(lines) == 2  # a point without a fraction is not judged
    assert target_lines(rows[:1])[0].startswith("link-bound points at >= 90% of the bound: 0 of 1")
    # torch.distributed's row is not one of hivepipe's points: it is compared with none
    gloo = _row(codec="torch:gloo", bandwidth_mbit=10, fraction_of_bound=0.5, binding="link stage1 up", **base)
    gloo.achieved.samples_per_s = 0.8
    lines = target_lines([rows[0], gloo])
    assert lines[0].startswith("link-bound points at >= 90% of the bound: 0 of 1 (lowest: none at 10")
    assert lines[1] == (
        "none against torch:gloo at 10 Mbit/s: 1.0 against 0.8 samples/s, 1.25x (target >= 1x: met); gloo at 50% of its bound"
    )
    gloo.achieved.samples_per_s = 1.25
    assert target_lines([rows[0], gloo])[1].split("(")[1].startswith("target >= 1x: missed by 20%")


def test_the_setup_line_names_the_real_boundary_sizes_and_the_small_compute():
    line = describe_setup("configs/bench/relay-layer1.yaml", ["model.num_stages=4"], cores=2)
    assert line.count("[64, 32, 32] (256 KiB in float32)") == 3 and "almost no compute" in line and "2 cores" in line
    assert "[1024, 768] (3,072 KiB in float32)" in describe_setup(
        "configs/bench/relay-layer1.yaml", ["model.num_stages=2", "model.options.boundary=gpt2"], cores=2
    )


def test_rows_as_json_table_and_plot(tmp_path):
    base = dict(
        backward="none",
        schedule_bound=9.0,
        busiest_bytes_per_sample=1e6,
        binding="link stage1 up",
        forward_bytes=[1e6],
        backward_bytes=[1e6],
        stage_ms_per_sample=[2.0],
        steps=4,
        shaping="netns",
    )
    rows = [
        _row(
            codec="none",
            bandwidth_mbit=mbit,
            samples_per_s=mbit / 10,
            link_bound=mbit / 8,
            compute_bound=400.0,
            fraction_of_bound=0.8,
            **base,
        )
        for mbit in (10, 100)
    ]
    rows.append(
        _row(
            codec="quant:4",
            bandwidth_mbit=100,
            samples_per_s=90.0,
            link_bound=100.0,
            compute_bound=math.inf,
            fraction_of_bound=0.9,
            **base,
        )
    )
    data = json.loads(to_json(rows))
    assert [(r["codec"], r["bandwidth_mbit"], r["samples_per_s"]) for r in data] == [
        ("none", 10, 1.0),
        ("none", 100, 10.0),
        ("quant:4", 100, 90.0),
    ]
    assert {"codec", "bandwidth_mbit", "samples_per_s", "link_bound", "compute_bound", "fraction_of_bound"} <= set(
        data[0]
    )
    table = format_rows(rows).splitlines()
    assert len(table) == 4 and table[0].split()[:2] == ["codec", "(fw"] and "90%" in table[3]
    path = tmp_path / "plots" / "throughput.png"
    plot(rows, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["throughput.json", "throughput-gloo.json", "throughput-gpt2.json"])
def test_the_committed_json_rows_load_and_write_back_the_same_flat_keys_and_values(name):
    text = (DOCS / name).read_text()
    rows = from_json(text)
    written, committed = json.loads(to_json(rows)), json.loads(text)
    assert rows and len(written) == len(committed)
    for new, old in zip(written, committed, strict=True):
        # every key the file has, with its value; a field newer than the file takes its default
        assert {key: new[key] for key in old} == old
        assert {key: new[key] for key in set(new) - set(old)} in ({}, {"delay_ms": 0.0, "schedule_fraction": None})


def test_faster_points_run_enough_steps_for_the_time_budget():
    slow = [
        _row(codec="topk:0.1", bandwidth_mbit=10, samples_per_s=16, compute_bound=400),
        _row(codec="topk:0.1", bandwidth_mbit=100, samples_per_s=170, compute_bound=450),
    ]
    assert expected_samples_per_s([], 10) is None
    assert expected_samples_per_s(slow[:1], 50) == pytest.approx(80)  # scales with the rate
    assert expected_samples_per_s(slow, 500) == pytest.approx(450)  # the nearest slower point's compute bound caps it
    assert expected_samples_per_s(slow, 5) is None  # nothing slower to go by
    assert steps_for(20, 512, None, 4) == 4
    assert steps_for(0, 512, 450, 4) == 4  # no budget: --steps
    assert steps_for(20, 512, 450, 4) == 1 + math.ceil(20 * 450 / 512)  # the warm-up step, then ~20 s
    assert steps_for(20, 512, 16, 4) == 4  # a slow point's few steps already last minutes
    assert steps_for(1000, 512, 450, 4) == MAX_STEPS
