"""swarm.engine.diverged.is_finite: the one-reduction test agrees with the element-wise one."""

import pytest
import torch

from swarm.engine.diverged import is_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_single_non_finite_value_anywhere_is_found(dtype, bad):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        tensor = torch.randn(3, 17, 5, generator=generator).to(dtype)
        position = int(torch.randint(tensor.numel(), (1,), generator=generator))
        tensor.view(-1)[position] = bad
        assert not is_finite(tensor)


def test_opposite_infinities_do_not_cancel():
    assert not is_finite(torch.tensor([float("inf"), float("-inf"), 1.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
    largest = torch.finfo(dtype).max
    tensor = torch.full((64,), largest, dtype=dtype)
    assert not torch.isfinite(tensor.sum())  # the fast path's sum overflows: the element-wise test decides
    assert is_finite(tensor)


def test_integers_and_empty_tensors_are_finite():
    assert is_finite(torch.arange(10))
    assert is_finite(torch.empty(0, 4))
    assert is_finite(torch.randn(2, 3))
