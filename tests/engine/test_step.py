"""The synchronous step's maths (swarm.engine.step), written once for both transports."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.engine.step import clip_scale, synchronous_step, tie, tied_names
from swarm.models import TiedPair

PAIR = TiedPair((0, "wte.weight"), (3, "lm_head.weight"))


def test_both_copies_of_a_tied_parameter_get_the_sum_and_its_square_is_counted():
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -4.0])
    grads: dict = {}
    squares = tie({0: {"wte.weight": first}, 3: {"lm_head.weight": second}}, [PAIR], grads)
    assert torch.equal(grads[0]["wte.weight"], torch.tensor([1.5, -2.0]))
    assert torch.equal(grads[3]["lm_head.weight"], torch.tensor([1.5, -2.0]))
    assert squares == [1.5**2 + 2.0**2]


def test_a_copy_without_a_gradient_counts_as_zero_and_a_pair_without_any_is_left_alone():
    only = torch.tensor([3.0])
    grads: dict = {}
    assert tie({3: {"lm_head.weight": only}}, [PAIR], grads) == [9.0]
    assert torch.equal(grads[0]["wte.weight"], only)
    untouched: dict = {}
    assert tie({}, [PAIR], untouched) == [] and untouched == {}


def test_clipping_counts_a_tied_parameter_once_and_scales_only_past_the_limit():
    assert clip_scale(25.0, [], None) == 0.0  # no clipping configured
    assert clip_scale(9.0, [], 5.0) == 0.0  # norm 3 is under the limit
    assert clip_scale(25.0 + 16.0, [16.0], 1.0) == pytest.approx(1.0 / (5.0 + 1e-6))
    assert clip_scale(25.0 + 16.0, [], 1.0) == pytest.approx(1.0 / (math.sqrt(41.0) + 1e-6))


class _Rounds:
    """Records the rounds a step asks for: two stages, stage 1 replicated."""

    def __init__(self) -> None:
        self.calls: list = []

    def gather(self, wanted):
        self.calls.append(("gather", wanted))
        return {0: {"wte.weight": torch.tensor([3.0])}, 1: {"w": torch.tensor([4.0])}}

    def replicated(self, stage: int) -> bool:
        return stage == 1

    def set_gradients(self, grads, norm: bool) -> float:
        self.calls.append(("set", sorted((s, sorted(g)) for s, g in grads.items()), norm))
        return 9.0 + 16.0

    def apply(self, scale: float) -> float:
        self.calls.append(("apply", scale))
        return 0.1


def test_a_step_gathers_sets_back_a_replicated_stage_clips_and_applies():
    rounds = _Rounds()
    assert synchronous_step(rounds, [], grad_clip=1.0) == 0.1
    gather, set_round, apply = rounds.calls
    assert gather == ("gather", {})
    assert set_round == ("set", [(1, ["w"])], True)  # the replicas' sum goes back; stage 0 is not replicated
    assert apply[0] == "apply" and apply[1] == pytest.approx(1.0 / (5.0 + 1e-6))


def test_a_step_without_clipping_or_anything_to_set_goes_straight_to_apply():
    class Unreplicated(_Rounds):
        def replicated(self, stage: int) -> bool:
            return False

    rounds = Unreplicated()
    synchronous_step(rounds, [], grad_clip=None)
    assert [call[0] for call in rounds.calls] == ["gather", "apply"] and rounds.calls[-1] == ("apply", 0.0)
    assert tied_names([PAIR]) == {0: ["wte.weight"], 3: ["lm_head.weight"]}
