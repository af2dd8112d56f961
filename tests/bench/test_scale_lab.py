"""bench scale-lab's rows (swarm.bench.scale_lab_figures, scale_lab_run, scale_lab_table): a lab
run's results, timelines and memory as a row of docs/bench/scale.json with the model beside it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from swarm.bench.fluid_records import StaleRecords
from swarm.bench.fluid_swarm import Routing, simulate_swarm
from swarm.bench.scale_lab import LabSetup, LabTraffic, LabTrain, lab_samples_per_s, lab_step
from swarm.bench.scale_lab_figures import LabPoint, LabRun, StageParams, lab_row
from swarm.bench.scale_lab_links import link_use, steady_window, union_s
from swarm.bench.scale_lab_run import stage_params, write_lab_rows
from swarm.bench.scale_lab_table import scaling, table
from swarm.cli.bench_scale_lab import parse_points
from swarm.transport.hivemind.flow.pacing import PAYLOAD_SHARE

TRAIN = {"batch_size": 128, "micro_batches": 32, "in_flight": 16}
BOUNDARY = 131_072  # payload bytes per sample, each way


def step(n: int, time_s: float, peers: list[tuple[int, int]]) -> dict:
    """The trainer's step row after `n` steps of 128 samples; `peers`: (stage, samples so far)."""
    return {
        "type": "step",
        "step": n,
        "samples": 128 * n,
        "time_s": time_s,
        "bytes": {"boundary0.forward.train": BOUNDARY * 128, "boundary0.backward.train": BOUNDARY * 128},  # this step's
        "stages": [
            {"stage": s, "compute_s": done * 0.002, "compute_cpu_s": done * 0.001, "samples": done} for s, done in peers
        ],
    }


def gathers(durations: list[float]) -> dict:
    """A stage peer's timeline: one gather span per step."""
    events = [
        {"name": "gather", "ph": "X", "ts": 1e6 * i, "dur": 1e6 * d, "args": {"step": i}}
        for i, d in enumerate(durations)
    ]
    return {"traceEvents": [{"name": "forward", "ph": "X", "ts": 0, "dur": 10, "args": {"mb": "0"}}, *events]}


def two_by_two_run() -> LabRun:
    """2 stages x 2 replicas, 3 steps of 10 s after a 12 s warm-up; of the steady 96 micro-batches
    stage 0's replicas ran 50 and 46, stage 1's 44 and 52."""
    rows = [
        {"type": "config", "config": {"train": TRAIN}},
        step(1, 12.0, [(0, 64), (0, 64), (1, 64), (1, 64)]),
        step(2, 22.0, [(0, 128), (0, 128), (1, 120), (1, 136)]),
        step(3, 32.0, [(0, 200), (0, 184), (1, 180), (1, 204)]),
        step(4, 42.0, [(0, 264), (0, 248), (1, 240), (1, 272)]),
        {"type": "summary", "steps": 4, "closed_on_the_way": 0},
    ]
    timelines = {
        "stage0": gathers([0.5, 0.06, 0.04, 0.05]),  # the warm-up step's (0) is left out
        "stage0.2": gathers([0.5, 0.04, 0.06, 0.05]),
        "stage1": gathers([0.5, 0.02, 0.02, 0.02]),
        "stage1.2": gathers([0.5, 0.02, 0.02, 0.02]),
        "trainer": {"traceEvents": []},
    }
    memory = {f"stage{n}": {"rss": 600.0 + i, "private": 300.0, "p2pd": 70.0} for i, n in enumerate(("0", "0.2", "1"))}
    return LabRun(rows, timelines, memory, input_bytes=12_300.0)


def test_a_lab_run_becomes_a_row_with_the_model_s_prediction_for_the_same_swarm():
    point = LabPoint(2, {0: 2, 1: 2}, bandwidth_mbit=10.0)
    params = StageParams([4 * 1000.0, 4 * 2000.0], [2, 2])
    row = lab_row(point, two_by_two_run(), params)
    assert row["kind"] == "lab" and (row["stages"], row["replicas"], row["peers"]) == (2, 2, 4)
    assert row["samples_per_s"] == pytest.approx(384 / 30.0, abs=1e-3)  # the warm-up step left out
    assert row["micro_batches_per_replica"] == {"0": [50, 46], "1": [52, 44]}
    assert row["gather_s"] == pytest.approx([0.05, 0.02])
    assert (row["allreduce_s"], row["allreduce_group"]) == (pytest.approx(0.05), 2)
    assert (row["rss_mib_per_peer"], row["private_mib_per_peer"], row["p2pd_rss_mib_per_peer"]) == (602.0, 300.0, 70.0)
    assert row["wire_overhead"] == 1.0  # no link counts without namespaces
    # the model's swarm: the same replicas, links and measured payloads and compute, on the wire at
    # 1 / PAYLOAD_SHARE, the stages' parameters averaged, the step's rounds after it
    wire = BOUNDARY / PAYLOAD_SHARE
    setup = LabSetup(
        2,
        [2, 2],
        10.0,
        0.0,
        row["stage_ms_per_sample"],
        LabTraffic([wire], [wire], 12_300.0 / PAYLOAD_SHARE, params.param_bytes, params.tensors),
        LabTrain(128, 32, 16, 2),
    )
    assert row["model_samples_per_s"] == pytest.approx(lab_samples_per_s(setup), rel=1e-3)
    assert row["model_error"] == pytest.approx(row["model_samples_per_s"] / row["samples_per_s"] - 1, abs=2e-3)
    assert "| 2 | 2 | 4 | 12.80 |" in table([{**row, "load": [1.0, 2.0]}])


def test_lab_rows_replace_their_own_keep_the_model_s_and_scaling_is_per_added_replica(tmp_path):
    path = tmp_path / "scale.json"
    model = {"kind": "model", "stages": 2, "replicas": 1, "samples_per_s": 1.0}
    path.write_text(json.dumps([{"kind": "lab", "stages": 2, "replicas": 9}, model]))
    rows = [
        {"kind": "lab", "stages": 2, "replicas": r, "samples_per_s": s, "model_samples_per_s": m}
        for r, s, m in ((1, 8.0, 8.0), (2, 14.0, 16.0), (4, 24.0, 30.0))
    ]
    write_lab_rows(path, rows)
    assert json.loads(path.read_text()) == [*rows, model]
    (line,) = scaling(rows)
    # 1->2 added 6 of one replica's 8 samples/s, 2->4 5 each; 4 replicas reach 24 / 32
    assert "1->2: 0.75 (model 1.00); 2->4: 0.62 (model 0.88); 4 replicas reach 0.75" in line


def test_points_parse_and_the_stages_parameters_are_the_model_s():
    assert parse_points("2x1 2x4\n3x1=2") == [(2, "1"), (2, "4"), (3, "1=2")]
    for bad in ("2", "1x1", "2x0", "2x5=2", ""):
        with pytest.raises(ValueError):
            parse_points(bad)
    params = stage_params("configs/bench/scale-lab.yaml", ["model.num_stages=2"])
    assert len(params.param_bytes) == 2 and all(b > 0 for b in params.param_bytes)
    assert params.tensors[0] == 2  # the stem's 1x1 convolution: weight and bias


def test_a_peer_s_link_use_is_its_sending_time_and_payload_rate_in_the_steady_steps():
    assert union_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    trainer = {
        "traceEvents": [{"name": f"step {i}", "ph": "X", "ts": 1e6 * (10 * i + 9), "dur": 1e6} for i in range(3)]
    }
    assert steady_window(trainer, 1) == (10.0, 30.0)
    thread = {"name": "thread_name", "ph": "M", "tid": 3, "args": {"name": "send to stage2 ab12"}}
    back = {"name": "thread_name", "ph": "M", "tid": 4, "args": {"name": "send to stage0 cd34"}}
    sends = [{"name": "send", "ph": "X", "tid": 3, "ts": 1e6 * t, "dur": 2e6} for t in (5, 12, 13, 20)]
    sends.append({"name": "send", "ph": "X", "tid": 4, "ts": 25e6, "dur": 1e6})
    use = link_use({"traceEvents": [thread, back, *sends]}, (10.0, 30.0), 1, {"forward": 1e6, "backward": 5e5})
    # in the window: 12-15 (two forwards overlapping), 20-22, 25-26 (a backward): 6 of 20 s
    assert use.busy == pytest.approx(6 / 20)
    assert use.payload_bits_per_s == pytest.approx(8 * (3 * 1e6 + 5e5) / 6)


def test_senders_read_records_as_old_as_the_dht_s():
    state = {"a": (3, 10.0), "b": (0, 20.0)}
    records = StaleRecords(announce_s=5.0, lookup_s=5.0, now=lambda name: state[name])
    # a stage's replicas announce at 1.25 s and 3.75 s, then every 5 s; a first lookup sees the step's start
    assert records.read("trainer", ["a", "b"], 0.0) == {"a": (0, 0.0), "b": (0, 0.0)}
    assert records.read("trainer", ["a", "b"], 4.0) == {"a": (0, 0.0), "b": (0, 0.0)}  # looked up at 0 s
    assert records.read("stage0", ["a", "b"], 4.0) == state  # another sender's first lookup: both announced
    state["a"] = (9, 1.0)
    assert records.read("trainer", ["a", "b"], 5.0)["a"] == (3, 10.0)  # a's next record is due at 6.25 s
    live = StaleRecords(0.0, 0.0, now=lambda name: state[name])
    assert live.read("trainer", ["a", "b"], 0.0) == state


def test_sticky_senders_on_stale_records_cost_a_link_bound_stage_s_replicas_their_share():
    """Senders that keep their last replica (stateful links: error feedback) pile micro-batches on
    it while the others' records show old queues; on stateless links they no longer keep it."""

    def samples_per_s(replicas: int, routing: Routing) -> float:
        wire = BOUNDARY / PAYLOAD_SHARE
        setup = LabSetup(
            2, replicas, 10.0, 0.0, [2.0, 2.5], LabTraffic([wire], [wire], 12_300.0), LabTrain(256, 64, 48)
        )
        return 256 / simulate_swarm(replace(lab_step(setup), routing=routing)).step_s

    one = samples_per_s(1, Routing())
    sticky, spread, ideal = (
        samples_per_s(4, Routing(stateful=True)),
        samples_per_s(4, Routing()),
        samples_per_s(4, Routing(announce_s=0.0, lookup_s=0.0, keep_factor=1.0)),
    )
    assert ideal >= 0.8 * 4 * one  # current records, no stickiness: close to four replicas' links
    assert sticky < 0.85 * ideal  # kept replicas on stale records: micro-batches pile on one at a time
    assert spread > sticky  # a stateless link's sender takes the best score every time
