"""The throughput benchmark's arithmetic and the lab's --bandwidth parsing (no network here: the
shaped swarm itself is exercised in tests/test_swarm.py and tests/test_netlab.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from swarm.bench.throughput_figures import RunLinks, ThroughputRow, measure_run
from swarm.bench.throughput_table import (
    cpu_breakdown,
)
from swarm.lab.bandwidth import parse_rates
from swarm.netlab.counters import CounterSampler, window

NAMES = ["bootstrap", "stage0", "stage1", "stage2", "trainer"]
DOCS = Path(__file__).parents[2] / "docs" / "bench"  # the committed figures


def _rows(samples_per_step=64, seconds_per_step=2.0, fw=1000, bw=500, steps=4):
    rows = [
        {"type": "config", "config": {"train": {"batch_size": samples_per_step, "micro_batches": 8, "in_flight": 8}}}
    ]
    for i in range(1, steps + 1):
        rows.append(
            {
                "type": "step",
                "step": i,
                "samples": i * samples_per_step,
                "time_s": 10.0 + i * seconds_per_step,
                "bytes": {
                    "boundary0.forward.train": fw * samples_per_step,
                    "boundary0.backward.train": bw * samples_per_step,
                    "boundary1.forward.train": fw * samples_per_step,
                    "boundary1.backward.train": bw * samples_per_step,
                },
            }
        )
    rows.append(
        {
            "type": "stages",
            "stages": [
                {"stage": 0, "compute_s": 1.0, "samples": 100},
                {"stage": 1, "compute_s": 2.0, "samples": 100},
                {"stage": 1, "compute_s": 2.0, "samples": 100},
                {"stage": 2, "compute_s": 0.5, "samples": 100},
            ],
        }
    )
    return rows


def test_measure_run_uses_steady_steps_wire_bytes_and_the_slowest_stage():
    figures = measure_run(_rows(), stages=3, links=RunLinks(8_000_000), input_bytes=0.0)
    assert figures["samples_per_s"] == pytest.approx(32.0)  # steps 2..4 after the warm-up step
    assert figures["forward_bytes"] == pytest.approx([1000, 1000]) and figures["backward_bytes"] == pytest.approx(
        [500, 500]
    )
    assert figures["compute_bound"] == pytest.approx(50.0)  # stage 1: two peers, 4 s over 200 samples
    # stage1's up link sends 1000 B forward and 500 B back per sample: 1 MB/s / 1500 B
    assert figures["link_bound"] == pytest.approx(1_000_000 / 1500)
    assert figures["binding"] == "compute"
    assert figures["fraction_of_bound"] == pytest.approx(32.0 / 50.0)
    assert figures["stage_ms_per_sample"] == pytest.approx([10.0, 20.0, 5.0])
    # one step of 8 micro-batches cannot beat the slowest stage's compute: 64 x 20 ms
    assert 0 < figures["schedule_bound"] < figures["compute_bound"]
    # an evaluation's traffic (counted in the next step's row) is not a training sample's
    rows = _rows()
    for row in rows[2:4]:
        row["bytes"]["boundary0.forward.eval"] = 10**6
    assert measure_run(rows, stages=3, links=RunLinks(8_000_000), input_bytes=0.0)["forward_bytes"] == pytest.approx(
        [1000, 1000]
    )


def test_stages_sharing_cores_are_bound_by_their_summed_cpu_time():
    rows = _rows()
    for peer in rows[-1]["stages"]:
        peer["compute_cpu_s"] = peer["compute_s"] * 0.9
    figures = measure_run(rows, stages=3, links=RunLinks(8_000_000), input_bytes=0.0, cores=1)
    # per sample: 9 + 18 + 4.5 ms of CPU on one core -> 1 / 31.5 ms, below the slowest stage's 50/s
    assert figures["cores_bound"] == pytest.approx(1 / 0.0315) and figures["compute_bound"] == figures["cores_bound"]
    assert figures["binding"] == "cores (1 shared)" and figures["fraction_of_bound"] == pytest.approx(32.0 * 0.0315)
    # 127/s on 4 cores
    assert measure_run(rows, stages=3, links=RunLinks(8_000_000), input_bytes=0.0, cores=4)["binding"] == "compute"
    # peers that did not report CPU time
    assert measure_run(_rows(), stages=3, links=RunLinks(8_000_000), input_bytes=0.0, cores=1)["cores_bound"] is None


def test_stage_compute_is_taken_over_the_measured_steps_when_the_step_rows_carry_it():
    """Step rows carry each stage peer's running compute totals: the warm-up step (10 ms per sample
    everywhere) is left out, as it is from samples/s; without them, or when a peer left meanwhile,
    the whole run's stages row (10, 20 and 5 ms per sample) is used."""
    rows = _rows()
    for row in rows:
        if row["type"] == "step":
            row["stages"] = [
                {
                    "stage": stage,
                    "compute_s": 64 * (0.010 + ms / 1000 * (row["step"] - 1)),
                    "compute_cpu_s": 32 * (0.010 + ms / 1000 * (row["step"] - 1)),
                    "samples": 64 * row["step"],
                }
                for stage, ms in enumerate((1, 4, 2))
            ]
    figures = measure_run(rows, stages=3, links=RunLinks(8_000_000), input_bytes=0.0, cores=2)
    assert figures["stage_ms_per_sample"] == pytest.approx([1.0, 4.0, 2.0])  # steps 2..4 only
    assert figures["compute_bound"] == pytest.approx(250.0) and figures["compute_cpu_ms_per_sample"] == pytest.approx(
        3.5
    )
    assert measure_run(_rows(), stages=3, links=RunLinks(8_000_000), input_bytes=0.0)[
        "stage_ms_per_sample"
    ] == pytest.approx([10.0, 20.0, 5.0])
    rows[-2]["stages"] = rows[-2]["stages"][:2]  # the stage-2 peer left before the last step: its totals went with it
    assert measure_run(rows, stages=3, links=RunLinks(8_000_000), input_bytes=0.0)[
        "stage_ms_per_sample"
    ] == pytest.approx([10.0, 20.0, 5.0])
    rows[-2]["stages"] = [{**peer, "compute_s": 0.0} for peer in rows[3]["stages"]]  # totals that went backwards
    assert measure_run(rows, stages=3, links=RunLinks(8_000_000), input_bytes=0.0)[
        "stage_ms_per_sample"
    ] == pytest.approx([10.0, 20.0, 5.0])


def test_measure_run_is_link_bound_on_a_slow_link_and_refuses_too_few_steps():
    figures = measure_run(_rows(), stages=3, links=RunLinks(80_000), input_bytes=0.0)
    assert figures["binding"].startswith("link stage1") and figures["link_bound"] == pytest.approx(10_000 / 1500)
    # fill and drain cost, not more
    assert 0.5 * figures["link_bound"] < figures["schedule_bound"] < figures["link_bound"]
    with pytest.raises(ValueError, match="at least 2"):
        measure_run(_rows(steps=1), stages=3, links=RunLinks(80_000), input_bytes=0.0)


def _meter(
    links_per_second: dict[str, tuple[int, int]],
    busy_per_second: float,
    until: float,
    cpu_per_second: dict[str, tuple[float, float]] | None = None,
) -> dict:
    """A lab's meter row: counters growing linearly from t=0, one sample per second."""
    return {
        "type": "meter",
        "every_s": 1.0,
        "samples": [
            {
                "at": float(t),
                "links": {n: [t * up, t * down] for n, (up, down) in links_per_second.items()},
                "cpu_busy_s": t * busy_per_second,
                "cpu_total_s": 2.0 * t,
                **(
                    {"cpu": {n: [t * own, t * daemon] for n, (own, daemon) in cpu_per_second.items()}}
                    if cpu_per_second
                    else {}
                ),
            }
            for t in range(int(until) + 2)
        ],
    }


def test_meter_window_interpolates_between_samples_and_refuses_an_uncovered_window():
    row = {
        "type": "meter",
        "samples": [
            {"at": 0.0, "links": {"a": [0, 0]}, "cpu_busy_s": 0.0, "cpu_total_s": 0.0, "cpu": {"a": [0.0, 0.0]}},
            {
                "at": 1.0,
                "links": {"a": [100, 50]},
                "cpu_busy_s": 1.0,
                "cpu_total_s": 2.0,
                "cpu": {"a": [0.4, 0.2], "b": [0.1, 0.0]},
            },
            {
                "at": 2.0,
                "links": {"a": [300, 150]},
                "cpu_busy_s": 1.5,
                "cpu_total_s": 4.0,
                "cpu": {"a": [0.6, 0.6], "b": [0.3, 0.1]},
            },
        ],
    }
    counted = window(row, 0.5, 1.5)
    assert counted.sent == {"a": pytest.approx(150.0)} and counted.received == {"a": pytest.approx(75.0)}
    assert counted.busy == pytest.approx((1.25 - 0.5) / (3.0 - 1.0)) and counted.busy_s == pytest.approx(0.75)
    # process b was not there at first: it counts from zero
    assert counted.cpu == {"a": pytest.approx([0.5 - 0.2, 0.4 - 0.1]), "b": pytest.approx([0.2 - 0.05, 0.05])}
    del row["samples"][1]["cpu"]  # a meter without process CPU (an older results file)
    assert window(row, 0.5, 1.5).cpu == {}
    with pytest.raises(ValueError, match="do not cover"):
        window(row, 0.5, 2.5)
    with pytest.raises(ValueError, match="empty window"):
        window(row, 1.0, 1.0)


def test_the_meter_stamps_a_sample_while_it_reads_and_keeps_the_cpu_readings():
    readings = iter([{"a": [1.0, 0.5]}, {"a": [1.5, 0.5], "b": [0.2, 0.1]}])
    sampler = CounterSampler(dict, lambda: next(readings))
    before = time.time()
    sampler.sample()
    sampler.sample()
    assert [s["cpu"] for s in sampler.samples] == [{"a": [1.0, 0.5]}, {"a": [1.5, 0.5], "b": [0.2, 0.1]}]
    assert (
        before <= sampler.samples[0]["at"] <= sampler.samples[1]["at"] <= time.time()
        and sampler.samples[0]["links"] == {}
    )
    plain = CounterSampler(dict)  # no process CPU to read: none in the samples
    plain.sample()
    assert "cpu" not in plain.samples[0]


def test_counted_link_bytes_bound_the_link_and_name_the_busiest():
    """With a meter row, the link bound comes from what each link carried (headers and ACKs
    included), and the payload bound is kept beside it."""
    rows = _rows(seconds_per_step=2.0)
    for row in rows:
        if row["type"] == "step":
            row["at"] = row["time_s"]
    # per second: 32 samples/s; stage1 sends 60,000 B/s = 1875 B per sample (1500 payload + 25%)
    rows.append(
        _meter(
            {"stage0": (40_000, 30_000), "stage1": (60_000, 50_000), "trainer": (1000, 500)},
            busy_per_second=1.5,
            until=20,
        )
    )
    figures = measure_run(rows, stages=3, links=RunLinks(80_000), input_bytes=0.0)
    # peers that reported no CPU, a meter without it
    assert figures["cpu_ms_per_sample"] is None and figures["compute_share"] is None
    assert figures["wire_bytes_per_sample"]["stage1"] == pytest.approx([1875.0, 1562.5])
    assert figures["busiest_bytes_per_sample"] == pytest.approx(1875.0) and figures["binding"] == "link stage1 up"
    assert figures["link_bound"] == pytest.approx(10_000 / 1875) and figures["payload_link_bound"] == pytest.approx(
        10_000 / 1500
    )
    assert figures["fraction_of_bound"] == pytest.approx(32.0 / (10_000 / 1875))
    assert figures["machine_busy"] == pytest.approx(0.75)
    plain = measure_run(_rows(), stages=3, links=RunLinks(80_000), input_bytes=0.0)  # no meter: the payload bound
    assert plain["wire_bytes_per_sample"] is None and plain["link_bound"] == plain[
        "payload_link_bound"
    ] == pytest.approx(10_000 / 1500)
    assert plain["machine_busy"] is None and plain["machine_cpu_ms_per_sample"] is None


def test_cpu_per_sample_and_the_share_of_it_the_stages_computed():
    """The meter's CPU times become ms per sample; with the stages' computing threads' CPU, the share of
    the busy machine that computed (in process there are no link counts: the payload bound stays)."""
    rows = _rows(seconds_per_step=2.0)  # 32 samples/s
    for row in rows:
        if row["type"] == "step":
            row["at"] = row["time_s"]
    for peer in rows[-1]["stages"]:
        peer["compute_cpu_s"] = peer["compute_s"] / 4  # per sample: 2.5 + 5 + 1.25 ms
    rows.append(
        _meter(
            {},
            busy_per_second=0.64,
            until=20,
            cpu_per_second={
                "stage0": (0.16, 0.032),
                "stage1": (0.192, 0.048),
                "stage2": (0.064, 0.016),
                "trainer": (0.016, 0.0),
            },
        )
    )
    figures = measure_run(rows, stages=3, links=RunLinks(80_000), input_bytes=0.0, cores=2)
    assert figures["wire_bytes_per_sample"] is None and figures["link_bound"] == figures["payload_link_bound"]
    assert figures["machine_busy"] == pytest.approx(0.32) and figures["machine_cpu_ms_per_sample"] == pytest.approx(
        20.0
    )
    assert figures["cpu_ms_per_sample"] == {
        "stage0": pytest.approx([5.0, 1.0]),
        "stage1": pytest.approx([6.0, 1.5]),
        "stage2": pytest.approx([2.0, 0.5]),
        "trainer": pytest.approx([0.5, 0.0]),
    }
    assert figures["compute_cpu_ms_per_sample"] == pytest.approx(8.75) and figures["compute_share"] == pytest.approx(
        8.75 / 20
    )
    line = cpu_breakdown(
        ThroughputRow.from_json(
            {"codec": "none", "backward": "none", "bandwidth_mbit": 0.08, "shaping": "inprocess", **figures}
        )
    )
    assert line.startswith(
        "CPU per sample: 20.00 ms = stage compute 8.75 + stage peers' other threads 4.25 + stage p2p daemons 3.00"
    )
    assert line.endswith(
        "trainer and bootstrap (and daemons) 0.50 + the rest of the machine 3.50; compute is 44% of it"
    )


def test_lab_bandwidth_forms_and_errors(tmp_path):
    assert parse_rates("100mbit", NAMES) == dict.fromkeys(NAMES, "100mbit")
    assert parse_rates("stage1=20mbit,*=1gbit", NAMES)["stage1"] == "20mbit"
    assert parse_rates("stage1=20mbit", NAMES) == {"stage1": "20mbit"}
    table = tmp_path / "rates.yaml"
    table.write_text("stage0: 10mbit\n'*': 50mbit\n")
    assert (
        parse_rates(str(table), NAMES)["stage0"] == "10mbit" and parse_rates(str(table), NAMES)["trainer"] == "50mbit"
    )
    assert parse_rates(None, NAMES) is None
    with pytest.raises(ValueError, match="unknown process"):
        parse_rates("stage9=10mbit", NAMES)
    with pytest.raises(ValueError, match="bad rate"):
        parse_rates("fast", NAMES)
    with pytest.raises(ValueError, match="NAME=RATE"):
        parse_rates("stage1=10mbit,stage2", NAMES)
    with pytest.raises(ValueError, match="rates.yml does not exist"):
        parse_rates(str(tmp_path / "rates.yml"), NAMES)
    table.write_text("stage0: [10mbit\n")
    with pytest.raises(
        ValueError, match=r"rates.yaml is not readable YAML: expected ',' or '\]', but got .* \(line 2, column 1\)"
    ):
        parse_rates(str(table), NAMES)
    table.write_bytes(b"stage0: \xff\xfe10mbit\n")
    with pytest.raises(ValueError, match="rates.yaml is not readable YAML: 'utf-8' codec"):
        parse_rates(str(table), NAMES)
    table.write_text("- 10mbit\n")
    with pytest.raises(ValueError, match="must map process names to rates"):
        parse_rates(str(table), NAMES)


def test_the_asynchronous_schedule_bound_streams_two_open_steps_through_its_window():
    from swarm.bench.throughput_figures import PerSample, schedule_bound

    measured = PerSample([8_500] * 3, [8_500] * 3, [0.002] * 4, 1_000)
    links = RunLinks(10e6, 0.05, True)
    sync = {"batch_size": 32, "micro_batches": 8, "in_flight": 16}
    sync_bound = schedule_bound(sync, 4, links, measured, 3)
    narrow = schedule_bound({**sync, "schedule": "async", "in_flight": 8}, 4, links, measured, 3)
    wide = schedule_bound({**sync, "schedule": "async"}, 4, links, measured, 3)
    # one step admits at most its 8 micro-batches, however wide the window; two open steps admit 16
    assert schedule_bound({**sync, "in_flight": 8}, 4, links, measured, 3) == pytest.approx(sync_bound)
    assert sync_bound < narrow < wide
