"""Order-independent sums of a step's gradients: the same bits whatever adds them, in any order.

Floating-point addition is not associative, so replicas that split a step's micro-batches and
sum their parts with an all-reduce would get other floats than one process adding them in order
(the losses drift apart). Here every micro-batch's gradient of a parameter goes onto one
power-of-two grid before anything is added: its values become integers (`to_grid`), held in
float64. Integers below 2^53 add exactly in float64, in any order and grouping, so a stage's
micro-batches, its replicas' all-reduce (swarm.transport.hivemind.stage.averaging) and one process
all get the same integer sum; times the grid's step it is the gradient (`from_grid`).

The grid of a parameter is the step's: its exponent is the largest of the step's micro-batches'
(`grid_exponents`; replicas take the largest of theirs first, exactly: `exponent_counts`), so no
value overflows and none needs a redo. A micro-batch's largest value spans GRID_BITS bits, and a
sum of MAX_TERMS of them stays below 2^46, where an all-reduce's mean of up to MAX_GROUP members
still recovers every integer (`recovered`).

Precision: each value is rounded once, by at most 2^-(GRID_BITS + 1) of the step's largest value of
that parameter, and the sum is exact (a parameter only one micro-batch of the step holds keeps
that one's values: a sum of one term is itself, as a checkpoint's kept sum must be); fp32 summation rounds each partial sum, by up to 2^-24 of
it (tests/engine/test_exactsum.py measures both against float64; `python -m swarm bench exact-sum`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch

GRID_BITS = 36  # a micro-batch's largest value of a parameter is at most 2^GRID_BITS grid steps
MAX_TERMS = 1 << 10  # micro-batches per step: their sum stays below 2^46
MAX_GROUP = 16  # replicas in an all-reduce whose mean (sum / members) still gives back every integer
# frexp exponents of the largest value a gradient can hold (float32, bfloat16, float16: 2^-149 .. 2^128)
LOWEST_EXPONENT, HIGHEST_EXPONENT = -150, 129
BUCKETS = HIGHEST_EXPONENT - LOWEST_EXPONENT + 1

Terms = Iterable[Sequence[tuple[str, torch.Tensor]]]  # per micro-batch: (parameter name, gradient) pairs


def exponent(grad: torch.Tensor) -> int | None:
    """The smallest e with every finite |value| <= 2^e (None: no finite value but zeros; a NaN or
    infinity stays one on any grid and reaches the sum as one process's would)."""
    if grad.numel() == 0:
        return None
    magnitudes = grad.detach().abs()
    largest = magnitudes.max()
    if not torch.isfinite(largest):
        largest = torch.where(torch.isfinite(magnitudes), magnitudes, 0).max()
    largest = largest.double()
    if largest == 0:
        return None
    return int(torch.frexp(largest).exponent)


def grid_exponents(terms: Terms) -> dict[str, int]:
    """Per parameter, the largest exponent over the micro-batches `terms` (a parameter whose
    gradients are all zeros gets none: its sum is zeros on any grid)."""
    grid: dict[str, int] = {}
    for term in terms:
        for name, grad in term:
            e = exponent(grad)
            if e is not None and e > grid.get(name, LOWEST_EXPONENT - 1):
                grid[name] = e
    return grid


def term_counts(terms: Terms) -> dict[str, int]:
    """Per parameter, how many of `terms` hold a gradient of it. A sum of one term is that term, bit
    for bit (a step's gradients kept whole, as a checkpoint holds them, sum to themselves)."""
    counts: dict[str, int] = {}
    for term in terms:
        for name, _ in term:
            counts[name] = counts.get(name, 0) + 1
    return counts


def to_grid(grad: torch.Tensor, e: int | None) -> torch.Tensor:
    """`grad` in units of 2^(e - GRID_BITS), rounded to integers (float64; a power-of-two scaling
    of a float32 value is exact, so the only rounding is this one, half to even)."""
    if e is None:
        return torch.zeros(grad.shape, dtype=torch.float64, device=_float64_device(grad))
    return torch.round(torch.ldexp(as_float64(grad), torch.tensor(float(GRID_BITS - e), dtype=torch.float64)))


def _float64_device(grad: torch.Tensor) -> torch.device:
    return torch.device("cpu") if grad.device.type == "mps" else grad.device  # MPS has no float64


def as_float64(grad: torch.Tensor) -> torch.Tensor:
    """`grad` in float64, exactly (on the CPU where its device has no float64)."""
    return grad.detach().to(_float64_device(grad), torch.float64)


def from_grid(total: torch.Tensor, e: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The gradient an integer sum on grid `e` stands for, in `dtype` (rounded once, from the exact sum)."""
    if e is None:
        return torch.zeros(total.shape, dtype=dtype, device=total.device)
    return torch.ldexp(total, torch.tensor(float(e - GRID_BITS), dtype=torch.float64)).to(dtype)


def integer_sums(
    terms: Sequence[Sequence[tuple[str, torch.Tensor]]], grid: dict[str, int], single: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """Parameter name -> the sum of its micro-batches' gradients on `grid`, integers in float64
    (exact: the same bits in any order); a parameter in `single` (one term in the whole step holds
    it) keeps its values, in float64. Raises ValueError past MAX_TERMS micro-batches."""
    if len(terms) > MAX_TERMS:
        raise ValueError(f"an exact sum takes at most {MAX_TERMS} micro-batches per step, not {len(terms)}")
    sums: dict[str, torch.Tensor] = {}
    for term in terms:
        for name, grad in term:
            units = as_float64(grad) if name in single else to_grid(grad, grid.get(name))
            sums[name] = units if name not in sums else sums[name].add_(units)
    return sums


def exact_sum(terms: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Parameter name -> the sum of its gradients over `terms`, in their dtype, the same bits in any order."""
    counts = term_counts(terms)
    single = {name for name, count in counts.items() if count == 1}
    grid = grid_exponents(terms)
    like = {name: grad for term in terms for name, grad in term}  # each sum in its gradients' dtype and device
    return {
        name: (total if name in single else from_grid(total, grid.get(name), torch.float64)).to(
            like[name].device, like[name].dtype
        )
        for name, total in integer_sums(terms, grid, single).items()
    }


def exponent_counts(grid: dict[str, int], counts: dict[str, int], names: Sequence[str]) -> torch.Tensor:
    """`grid` as one-hot rows (a parameter without an exponent: zeros) and `term_counts` in a last
    column, which an all-reduce sums exactly: `exponents_from_counts` of the sum is the largest
    exponent of every member, and how many terms the whole step has of each parameter."""
    rows = torch.zeros(len(names), BUCKETS + 1, dtype=torch.float64)
    for row, name in enumerate(names):
        if name in grid:
            rows[row, grid[name] - LOWEST_EXPONENT] = 1.0
        rows[row, BUCKETS] = float(counts.get(name, 0))
    return rows.flatten()


def exponents_from_counts(summed: torch.Tensor, names: Sequence[str]) -> tuple[dict[str, int], set[str]]:
    """The step's grid (the largest exponent present per parameter) in summed `exponent_counts`, and
    the parameters a single term holds (its values are the sum)."""
    rows = summed.reshape(len(names), BUCKETS + 1)
    grid, single = {}, set()
    for row, name in enumerate(names):
        present = torch.nonzero(rows[row, :BUCKETS] > 0.5)
        if present.numel():
            grid[name] = int(present.max()) + LOWEST_EXPONENT
        if round(float(rows[row, BUCKETS])) == 1:
            single.add(name)
    return grid, single


def recovered(mean_times_members: torch.Tensor, members: int) -> torch.Tensor:
    """An all-reduce's integer sum given back as a mean times its `members` (rounded at most a few
    float64 ulps of 2^46 off): the exact integers again. Raises ValueError past MAX_GROUP members."""
    if members > MAX_GROUP:
        raise ValueError(f"an exact sum takes at most {MAX_GROUP} replicas in a group, not {members}")
    return torch.round(mean_times_members)
