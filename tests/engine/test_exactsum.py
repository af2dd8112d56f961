"""swarm.engine.exactsum: the same bits in any order or grouping, at least fp32 summation's precision."""

import random

import pytest
import torch

from swarm.engine.exactsum import (
    ABSENT,
    FIRST_EXPONENT,
    GRID_BITS,
    LOWEST_EXPONENT,
    MAX_GROUP,
    ZEROS,
    codes_from_counts,
    exact_sum,
    exponent_counts,
    from_grid,
    grid_check,
    grid_exponents,
    grid_holds,
    grid_of,
    integer_sums,
    merged_codes,
    pack_codes,
    pack_grid,
    recovered,
    step_codes,
    term_codes,
    term_counts,
    unpack_codes,
    unpack_grid,
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


def _code(e: int) -> int:
    return FIRST_EXPONENT + e - LOWEST_EXPONENT


def test_replicas_largest_exponent_travels_as_summable_counts():
    names = ["w", "b", "zeros", "none"]
    mine, theirs = (
        ([_code(-3), _code(7), ZEROS, ABSENT], [2, 1, 1, 0]),
        ([_code(5), ABSENT, ZEROS, ABSENT], [1, 0, 1, 0]),
    )
    summed = exponent_counts(*mine) + exponent_counts(*theirs)
    merged = codes_from_counts(summed, len(names))
    assert merged == merged_codes([mine[0], theirs[0]], 4)[:1] + ([3, 1, 2, 0],)
    assert grid_of(*merged, names) == ({"w": 5, "b": 7}, {"b"})


def test_one_merge_of_reports_gives_one_process_its_grid():
    """The trainer merges each micro-batch's report (as packed on the wire) into the grid its
    replicas sum on: the same grid and single terms as one process's `exact_sum` takes."""
    terms = _terms(6, 3)
    terms[2] = [("weight", torch.zeros(64, 33))]  # a micro-batch without the bias, and one of zeros
    names = ["weight", "bias"]
    reports = [unpack_codes(pack_codes(term_codes(term, names)), 2) for term in terms]
    grid = unpack_grid(pack_grid(*merged_codes(reports, 2)), 2)
    assert grid_of(*grid, names) == (grid_exponents(terms), {n for n, k in term_counts(terms).items() if k == 1})
    assert grid[1] == [6, 5] and unpack_grid(b"\x01", 2) is None and unpack_codes(pack_codes([999]), 1) is None


def test_a_grid_given_is_checked_by_the_members_own_exponents():
    """Replicas summing on a grid given add up `grid_check`s: it holds only if it is the step's
    (each exponent some member's, none above it, the counts right); else they redo the sum."""
    terms = _terms(4, 1)
    names = ["weight", "bias"]
    parts = [terms[:1], terms[1:]]  # two replicas' micro-batches
    codes, counts, _ = step_codes(terms, names)
    checks = [grid_check(*step_codes(part, names)[:2], codes) for part in parts]
    assert grid_holds(sum(checks), codes, counts)
    for wrong in ([c + 1 for c in codes], [c - 1 for c in codes]):  # coarser than any member's, or too fine
        assert not grid_holds(sum(grid_check(*step_codes(p, names)[:2], wrong) for p in parts), wrong, counts)
    assert not grid_holds(sum(checks), codes, [c + 1 for c in counts])


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
