"""The scale model (swarm.bench.scale_model and the fluid model over replicas it runs on): what
replicas, routing, averaging, churn and the DHT do to a swarm's samples/s, as properties."""

from __future__ import annotations

import json

import pytest

from swarm.bench.fluid_swarm import Link, Payloads, Replica, Schedule, SwarmStep, simulate_swarm
from swarm.bench.scale_dht import dht_load
from swarm.bench.scale_lab import LabSetup, LabTraffic, LabTrain, lab_samples_per_s
from swarm.bench.scale_model import ALLREDUCE_PEER_S, Churn, ScalePoint, Spread, Workload, allreduce_s, predict
from swarm.bench.scale_sweep import merge, model_row, write
from swarm.bench.throughput_figures import PerSample, RunLinks, schedule_bound
from swarm.cli.main import main

MB = 1e6  # bytes
FAST, SLOW = Link(100e6, 100e6, 0.0), Link(10e6, 10e6, 0.0)
OUTER = Link(40e6, 40e6, 0.0)


def three_stages(middle: int, middle_link: Link = SLOW, trainer: Link = FAST, input_bytes: float = 0.0) -> float:
    """Samples/s (a micro-batch a sample) of 3 stages whose middle one has `middle` replicas."""
    stages = [[Replica(OUTER, 0.001)], [Replica(middle_link, 0.001)] * middle, [Replica(OUTER, 0.001)]]
    step = SwarmStep(stages, Payloads([MB, MB], [MB, MB], input_bytes), Schedule(256, 64), trainer)
    return 256 / simulate_swarm(step).step_s


def test_replicas_of_a_link_bound_stage_add_throughput_up_to_the_next_bottleneck():
    one = three_stages(1)
    # the middle stage sends 2 MB a sample on a 10 Mbit/s link: 0.625 samples/s
    assert one == pytest.approx(0.625, rel=0.1)
    for replicas in (2, 4):
        assert three_stages(replicas) >= 0.85 * replicas * one
    # the first and last stages' 40 Mbit/s links carry 1 MB a sample each way: 5 samples/s at most
    many = three_stages(16)
    assert 0.75 * 5 < many <= 5
    assert many < 0.85 * 16 * one


def test_the_trainer_s_link_caps_the_swarm_whatever_its_replicas():
    # 1 MB of input a sample over the trainer's 10 Mbit/s: 1.25 samples/s at most
    few, many = three_stages(1, FAST, SLOW, MB), three_stages(8, FAST, SLOW, MB)
    assert few <= 1.25 and many <= 1.25
    assert many == pytest.approx(1.25, rel=0.1)


def test_routing_spreads_micro_batches_by_throughput_and_queue():
    def routed(compute: list[float]) -> list[int]:
        stages = [[Replica(FAST, 0.0)], [Replica(Link(1e12, 1e12), s) for s in compute]]
        step = SwarmStep(stages, Payloads([0.0], [0.0]), Schedule(300, 12), FAST)
        result = simulate_swarm(step)
        return [result.routed[f"stage1.{i}"] for i in range(len(compute))]

    equal = routed([0.01] * 3)
    assert sum(equal) == 300 and max(equal) - min(equal) <= 0.1 * 100
    fast, slow = routed([0.01, 0.02])
    assert 1.5 < fast / slow < 2.5  # twice the compute rate: about twice the micro-batches


def test_averaging_time_grows_with_group_size_as_the_butterfly_all_reduce_says():
    link = Link(80e6, 80e6, 0.05)
    nbytes = 10 * MB
    assert allreduce_s([link], nbytes) == 0.0
    times = [allreduce_s([link] * n, nbytes) for n in (2, 4, 8, 16)]
    for n, seconds in zip((2, 4, 8, 16), times, strict=True):
        # plus hivemind's own time for each other member
        assert seconds == pytest.approx(2 * ((n - 1) / n * nbytes / 10e6 + 0.05) + (n - 1) * ALLREDUCE_PEER_S)
    assert times == sorted(times)
    # the slowest member sets the pace
    slow = allreduce_s([link, link, Link(8e6, 8e6, 0.05)], nbytes)
    assert slow == pytest.approx(2 * (2 / 3 * nbytes / 1e6 + 0.05) + 2 * ALLREDUCE_PEER_S)


def small(replicas: int, leave_per_hour: float = 0.0) -> ScalePoint:
    return ScalePoint(
        4, replicas, Workload(param_bytes=4 * MB), Spread(seed=1), Churn(leave_per_hour), micro_batches=64
    )


def test_churn_lowers_samples_per_s_and_more_churn_lowers_it_more():
    calm, some, much = (predict(small(4, rate)).samples_per_s for rate in (0.0, 2.0, 20.0))
    assert calm > some > much
    assert predict(small(4, 20.0)).churn_s > 0


def test_a_stage_of_one_peer_under_churn_goes_back_to_the_copies():
    # the same departures cost far more where a stage has nobody else to take over (about twice the
    # share of the step here; the replicated point's routing, sticky on stale records, varies it)
    lone, replicated = predict(small(1, 5.0)), predict(small(2, 5.0))
    assert lone.churn_s / lone.step_s > 1.5 * replicated.churn_s / replicated.step_s


def test_the_code_s_limits_are_what_saturates_past_them():
    point = ScalePoint(2, 17, Workload(param_bytes=MB), micro_batches=34)
    assert predict(point).saturates == "group size"


def test_dht_records_follow_what_the_peers_publish_and_look_up():
    small_load, large = dht_load(4, 2, 10.0), dht_load(32, 32, 10.0)
    # every stage peer stores two records every announce_every_s (5 s), the trainer 2 / 5 s and its status every 2 s
    assert small_load.stores_per_s == pytest.approx(8 * 2 / 5 + 2 / 5 + 1 / 2)
    assert large.stores_per_s == pytest.approx(1024 * 2 / 5 + 2 / 5 + 1 / 2)
    # the run listing: every peer's entry and the trainer's on the same nodes
    assert large.hottest_stores_per_s == pytest.approx(1025 / 5)
    point = ScalePoint(2, 16, Workload(param_bytes=MB), micro_batches=32, dht_stores_per_s=5.0)
    assert predict(point).saturates == "DHT"


def test_a_lab_row_of_one_replica_per_stage_is_the_throughput_benchmark_s_schedule_bound():
    setup = LabSetup(
        stages=4,
        replicas=1,
        bandwidth_mbit=50,
        delay_ms=20,
        stage_ms_per_sample=[2.0, 3.0, 3.0, 2.0],
        traffic=LabTraffic([40_000] * 3, [30_000] * 3, 3_000),
        train=LabTrain(batch_size=128, micro_batches=32, in_flight=8, round_trips=3),
    )
    train = {"batch_size": 128, "micro_batches": 32, "in_flight": 8}
    measured = PerSample([40_000] * 3, [30_000] * 3, [0.002, 0.003, 0.003, 0.002], 3_000)
    bound = schedule_bound(train, 4, RunLinks(50e6, 0.02, True), measured, 3)
    assert lab_samples_per_s(setup) == pytest.approx(bound)
    # replicas add an all-reduce of the stage's parameters to the step
    averaged = LabSetup(
        **{**setup.__dict__, "replicas": 2, "traffic": LabTraffic([40_000] * 3, [30_000] * 3, 3_000, [4 * MB] * 4)}
    )
    assert lab_samples_per_s(averaged) < 2 * lab_samples_per_s(setup)


def test_model_rows_replace_their_own_and_keep_the_lab_s(tmp_path):
    path = tmp_path / "scale.json"
    lab = {"kind": "lab", "stages": 8, "replicas": 4, "peers": 32, "samples_per_s": 40.0, "rss_mib_per_peer": 400}
    path.write_text(json.dumps([lab, {"kind": "model", "stages": 2, "replicas": 1, "samples_per_s": 1.0}]))
    row = model_row(ScalePoint(2, 2, Workload(param_bytes=MB), micro_batches=16))
    assert row["kind"] == "model" and row["peers"] == 4 and row["rss_mib_per_peer"] is None
    assert row["samples_per_s"] == row["model_samples_per_s"] > 0
    write(path, [row])
    assert json.loads(path.read_text()) == [lab, row]
    assert merge(tmp_path / "none.json", [row]) == [row]


def test_bad_spreads_are_refused_in_one_line(capsys):
    assert main(["bench", "scale", "--bandwidth", "fast", "--json", "", "--plot", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: --bandwidth: expected LOW-HIGH, e.g. 10-100, got 'fast'"
    assert main(["bench", "scale", "--stages", "1", "--json", "", "--plot", ""]) == 2
