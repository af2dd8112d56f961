"""swarm.engine.exactsum: the same bits in any order or grouping, at least fp32 summation's precision."""

import random

import pytest
import torch

from swarm.engine.exactsum import (
    GRID_BITS,
    MAX_GROUP,
    exact_sum,
    exponent_counts,
    exponents_from_counts,
    from_grid,
    grid_exponents,
    integer_sums,
    recovered,
)


def _terms(count: int, seed: int, spread: float = 4.0) -> list[list[tuple[str, torch.Tensor]]]:
    """Micro-batches' gradients of two parameters, magnitudes over 2^±spread*... as training sees them."""
    gen = torch.Generator().manual_seed(seed)
    terms = []
    for _ in range(count):
        scale = float(torch.exp(torch.randn((), generator=gen) * spread))
        terms.append(
            [
                ("weight", torch.randn(64, 33, generator=gen) * scale),
                ("bias", torch.randn(33, generator=gen) * scale * 1e-3),
            ]
        )
    return terms


def _fp32_sum(terms) -> dict[str, torch.Tensor]:
    sums = {}
    for term in terms:
        for name, g in term:
            sums[name] = g.clone() if name not in sums else sums[name] + g
    return sums


@pytest.mark.parametrize("seed", range(5))
def test_any_order_and_grouping_gives_the_same_bits(seed):
    terms = _terms(12, seed)
    reference = exact_sum(terms)
    rng = random.Random(seed)
    grid = grid_exponents(terms)
    for _ in range(10):
        shuffled = terms[:]
        rng.shuffle(shuffled)
        assert all(torch.equal(exact_sum(shuffled)[n], reference[n]) for n in reference)
        # replicas: random groups, each summed on the step's grid, then their sums added up
        cut = sorted(rng.sample(range(1, len(terms)), 3))
        groups = [shuffled[a:b] for a, b in zip([0, *cut], [*cut, len(terms)], strict=True)]
        parts = [integer_sums(group, grid) for group in groups]
        rng.shuffle(parts)
        total = {n: sum(part[n] for part in parts) for n in reference}
        assert all(torch.equal(from_grid(total[n], grid[n], torch.float32), reference[n]) for n in reference)
    # floats added in two orders differ: what the exact sum is for
    assert any(not torch.equal(_fp32_sum(terms)[n], _fp32_sum(terms[::-1])[n]) for n in reference)


@pytest.mark.parametrize("seed", range(5))
def test_precision_is_at_least_fp32_summations(seed):
    terms = _terms(32, seed)
    exact = {n: sum(g.double() for t in terms for m, g in t if m == n) for n in ("weight", "bias")}
    ours, fp32 = exact_sum(terms), _fp32_sum(terms)
    for name, truth in exact.items():
        our_error = (ours[name].double() - truth).abs().max()
        fp32_error = (fp32[name].double() - truth).abs().max()
        assert our_error <= fp32_error, (name, float(our_error), float(fp32_error))
        # before the one rounding to float32: within half a grid step per micro-batch
        e = grid_exponents(terms)[name]
        unrounded = torch.ldexp(integer_sums(terms, grid_exponents(terms))[name], torch.tensor(float(e - GRID_BITS)))
        assert (unrounded - truth).abs().max() <= len(terms) * 2.0 ** (e - GRID_BITS - 1)


def test_zeros_missing_parameters_and_non_finite_values():
    terms = [[("a", torch.zeros(3))], [("a", torch.zeros(3)), ("b", torch.tensor([1.0, -2.0]))]]
    sums = exact_sum(terms)
    assert torch.equal(sums["a"], torch.zeros(3)) and torch.equal(sums["b"], torch.tensor([1.0, -2.0]))
    nan = exact_sum([[("a", torch.tensor([1.0, float("nan")]))], [("a", torch.tensor([1.0, 1.0]))]])["a"]
    assert nan[0] == 2.0 and torch.isnan(nan[1])


def test_replicas_largest_exponent_travels_as_summable_counts():
    names = ["w", "b", "none"]
    mine, theirs = {"w": -3, "b": 7}, {"w": 5}
    summed = exponent_counts(mine, {"w": 2, "b": 1}, names) + exponent_counts(theirs, {"w": 1}, names)
    assert exponents_from_counts(summed, names) == ({"w": 5, "b": 7}, {"b"})


def test_a_sum_of_one_term_is_that_term_bit_for_bit():
    """What a checkpoint keeps of a step (its exact sum) held again as one micro-batch sums to itself."""
    terms = _terms(5, 0)
    kept = exact_sum(terms)
    again = exact_sum([list(kept.items()), [], []])
    assert all(torch.equal(again[n], kept[n]) for n in kept)


def test_an_all_reduce_mean_gives_back_the_integers():
    big = torch.tensor([2.0**46 - 1, -(2.0**46) + 3, 12345.0], dtype=torch.float64)
    for members in (3, 5, 7, MAX_GROUP):
        mean = big / members
        assert torch.equal(recovered(mean * members, members), big)
    with pytest.raises(ValueError, match="at most"):
        recovered(big, MAX_GROUP + 1)
