"""The fluid model of a pipeline step (swarm.bench.fluid): fair sharing and exact small cases."""

from __future__ import annotations

import pytest

from swarm.bench.fluid import StepModel, max_min_rates, simulate
from swarm.bench.throughput_figures import step_round_trips

MIB = 2**20


def test_max_min_rates_share_the_bottleneck_and_give_the_rest_away():
    assert max_min_rates([("a up", "b down"), ("a up", "c down")], 1.0) == pytest.approx([0.5, 0.5])
    # c's down link is split three ways; a's up link then gives its first flow what the second cannot use
    flows = [("a up", "b down"), ("a up", "c down"), ("d up", "c down"), ("e up", "c down")]
    assert max_min_rates(flows, 3.0) == pytest.approx([2.0, 1.0, 1.0, 1.0])


def test_weighted_rates_share_a_link_in_proportion():
    assert max_min_rates([("a up", "b down"), ("a up", "c down")], 1.0, [3.0, 1.0]) == pytest.approx([0.75, 0.25])
    # c's down link holds the second flow to a quarter of c's rate; a's up link gives the first the rest
    assert max_min_rates(
        [("a up", "b down"), ("a up", "c down"), ("d up", "c down")], 1.0, [1.0, 1.0, 3.0]
    ) == pytest.approx([0.75, 0.25, 0.75])


def test_waves_of_unequal_size_share_the_middle_links_by_size():
    """TopK activations carry indices, the reused-index gradients do not: the middle links carry
    33 + 26 units per sample. Shared by size, the step stays near the link bound (equal halves
    left the larger wave behind: 88% in this model)."""
    forward, backward = 33_000 * 8, 26_000 * 8
    model = StepModel(4, 64, 16, 1, [forward] * 3, [backward] * 3, [0.0] * 4, 100e6)
    busiest = 64 * (forward + backward) / (100e6 / 8)
    assert busiest / simulate(model).step_s > 0.93


def test_one_micro_batch_takes_the_sum_of_its_transfers_and_computes():
    rate = 8e6  # 1 MB/s
    model = StepModel(
        stages=2,
        micro_batches=1,
        in_flight=1,
        sending=1,
        forward_bytes=[500_000],
        backward_bytes=[250_000],
        compute_s=[0.1, 0.2],
        rate_bits=rate,
        input_bytes=100_000,
    )
    # input 0.1 s, forward 0.1 s on stage 0, activations 0.5 s, forward and backward 0.2 + 0.2 s on
    # stage 1, gradients 0.25 s, backward 0.1 s on stage 0: every transfer at the link's full rate
    assert simulate(model).step_s == pytest.approx(0.1 + 0.1 + 0.5 + 0.4 + 0.25 + 0.1)


def test_the_schedule_never_beats_the_link_bound_and_fills_with_more_micro_batches():
    def efficiency(micro_batches: int, sending: int = 2) -> float:
        model = StepModel(4, micro_batches, micro_batches, sending, [MIB] * 3, [MIB] * 3, [0.002] * 4, 100e6)
        busiest = 2 * micro_batches * MIB / (100e6 / 8)  # a middle stage sends both waves on its up link
        return busiest / simulate(model).step_s

    few, many = efficiency(4), efficiency(32)
    assert 0 < few < many <= 1.0
    assert efficiency(16, sending=1) > efficiency(16, sending=2)  # concurrent payloads slow the first arrival


def test_bad_models_are_refused():
    with pytest.raises(ValueError, match="forward_bytes needs 3 values"):
        StepModel(4, 16, 16, 2, [MIB] * 2, [MIB] * 3, [0.01] * 4, 1e8)
    with pytest.raises(ValueError, match="at least 2 stages"):
        StepModel(1, 16, 16, 2, [], [], [0.01], 1e8)


def test_every_hop_adds_its_delay_and_the_step_rounds_two_each():
    rate = 8e6  # 1 MB/s
    model = StepModel(2, 1, 1, 1, [500_000], [250_000], [0.1, 0.2], rate, input_bytes=100_000, delay_s=0.05)
    # the same step as without delay, plus four hops: the input, the activations, the gradients and
    # the reply to the trainer; then each round of the step goes there and back
    alone = 0.1 + 0.1 + 0.5 + 0.4 + 0.25 + 0.1
    assert simulate(model).step_s == pytest.approx(alone + 4 * 0.05)
    rounds = StepModel(2, 1, 1, 1, [500_000], [250_000], [0.1, 0.2], rate, 100_000, delay_s=0.05, round_trips=3)
    assert simulate(rounds).step_s == pytest.approx(alone + 4 * 0.05 + 3 * 2 * 0.05)


def test_marks_say_when_each_sender_s_payloads_go_as_a_traced_step_does():
    model = StepModel(2, 1, 1, 1, [500_000], [250_000], [0.1, 0.2], 8e6, input_bytes=100_000, delay_s=0.05)
    marks = simulate(model).marks()
    # the input is out at 0.1 and arrives at 0.15; stage 0 computes until 0.25, its activations are
    # out at 0.75; they arrive at 0.8, stage 1 computes until 1.2 and its gradients are out at 1.45;
    # they arrive at 1.5, stage 0's backward ends at 1.6 and its (empty) reply leaves then
    assert marks == {
        "trainer": pytest.approx((0.0, 0.1)),
        "stage0": pytest.approx((0.15 + 0.1, 1.6)),
        "stage1": pytest.approx((0.8 + 0.4, 1.45)),
    }


def test_a_run_whose_steps_all_closed_on_the_way_has_no_step_rounds():
    config = {"optimizer": {"grad_clip": 1.0}}
    assert step_round_trips(config) == 3
    assert step_round_trips({"optimizer": {}}, {"steps": 9, "closed_on_the_way": 8}) == 2
    assert step_round_trips(config, {"steps": 9, "closed_on_the_way": 9}) == 0


def test_latency_caps_a_pipeline_of_few_micro_batches_in_flight():
    # nothing to send or compute: each micro-batch is a round trip of 2 x stages hops, in_flight at a time
    model = StepModel(4, 16, 4, 1, [0.0] * 3, [0.0] * 3, [0.0] * 4, 1e9, delay_s=0.05)
    assert simulate(model).step_s == pytest.approx(16 / 4 * 8 * 0.05)
    with pytest.raises(ValueError, match="cannot be negative"):
        StepModel(4, 16, 4, 1, [0.0] * 3, [0.0] * 3, [0.0] * 4, 1e9, delay_s=-1.0)
