"""Order-independent sums of a step's gradients: the same bits whatever adds them, in any order.

Floating-point addition is not associative, so replicas that split a step's micro-batches and
sum their parts with an all-reduce would get other floats than one process adding them in order
(the losses drift apart). Here every micro-batch's gradient of a parameter goes onto one
power-of-two grid before anything is added: its values become integers (`to_grid`), held in
float64. Integers below 2^53 add exactly in float64, in any order and grouping, so a stage's
micro-batches, its replicas' all-reduce (swarm.transport.hivemind.stage.averaging) and one process
all get the same integer sum; times the grid's step it is the gradient (`from_grid`).

The grid of a parameter is the step's: its exponent is the largest of the step's micro-batches',
so no value overflows. Each micro-batch's exponents are one report (`term_codes`, a code per
parameter), and one merge of reports (`merged_codes`) gives the grid wherever it is chosen: one
process over its terms (`step_grid`), the trainer over the reports that come back with each
micro-batch (it hands the grid to a stage's replicas in the gather request: `pack_grid`), and
replicas that were given none, in a round of their own (`exponent_counts`). Replicas summing on a
grid they were given check it in the same all-reduce (`grid_check`, `grid_holds`): a grid that is
not the step's is redone by that round. A micro-batch's largest value spans GRID_BITS bits, and a
sum of MAX_TERMS of them stays below 2^46, where an all-reduce's mean of up to MAX_GROUP members
still recovers every integer (`recovered`).

Precision: each value is rounded once, by at most 2^-(GRID_BITS + 1) of the step's largest value of
that parameter, and the sum is exact (a parameter only one micro-batch of the step holds keeps
that one's values: a sum of one term is itself, as a checkpoint's kept sum must be); fp32 summation rounds each partial sum, by up to 2^-24 of
it (tests/engine/test_exactsum.py measures both against float64; `python -m swarm bench exact-sum`).
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable, Sequence

import torch

GRID_BITS = 36  # a micro-batch's largest value of a parameter is at most 2^GRID_BITS grid steps
MAX_TERMS = 1 << 10  # micro-batches per step: their sum stays below 2^46
MAX_GROUP = 16  # replicas in an all-reduce whose mean (sum / members) still gives back every integer
# frexp exponents of the largest value a gradient can hold (float32, bfloat16, float16: 2^-149 .. 2^128)
LOWEST_EXPONENT, HIGHEST_EXPONENT = -150, 129
BUCKETS = HIGHEST_EXPONENT - LOWEST_EXPONENT + 1
# A term's code of a parameter (`term_codes`): ABSENT (no gradient of it), ZEROS (no finite value but
# zeros), else FIRST_EXPONENT + its exponent - LOWEST_EXPONENT; a larger code is a coarser grid.
ABSENT, ZEROS, FIRST_EXPONENT = 0, 1, 2
MISFIT = float(1 << 20)  # a member's `grid_check` for a parameter it holds above the grid given
CHECK_VALUES = 2  # per parameter in a member's `grid_check`: its count and its verdict

Terms = Sequence[Sequence[tuple[str, torch.Tensor]]]  # per micro-batch: (parameter name, gradient) pairs


def exponent(grad: torch.Tensor) -> int | None:
    """The smallest e with every finite |value| <= 2^e (None: no finite value but zeros; a NaN or
    infinity stays one on any grid and reaches the sum as one process's would)."""
    if grad.numel() == 0:
        return None
    lowest, highest = torch.aminmax(grad.detach())  # one pass, no copy: every micro-batch is reported
    largest = torch.maximum(highest, -lowest)
    if not torch.isfinite(largest):
        magnitudes = grad.detach().abs()
        largest = torch.where(torch.isfinite(magnitudes), magnitudes, 0).max()
    largest = largest.double()
    if largest == 0:
        return None
    return int(torch.frexp(largest).exponent)


def term_codes(term: Sequence[tuple[str, torch.Tensor]], names: Sequence[str]) -> list[int]:
    """One micro-batch's report: per parameter of `names`, its code (ABSENT, ZEROS or its exponent's)."""
    held = dict(term)
    codes = []
    for name in names:
        e = exponent(held[name]) if name in held else None
        codes.append(ABSENT if name not in held else ZEROS if e is None else FIRST_EXPONENT + e - LOWEST_EXPONENT)
    return codes


def trained_names(module: torch.nn.Module) -> list[str]:
    """The parameters a report covers, in module order: those that train (a LoRA run's base never
    has a gradient)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def exponent_report(term: Sequence[tuple[str, torch.Tensor]], module: torch.nn.Module) -> bytes:
    """A micro-batch's gradients `term` of `module` as the trainer gets them (`term_codes`, packed)."""
    return pack_codes(term_codes(term, trained_names(module)))


def merged_codes(reports: Iterable[Sequence[int]], size: int) -> tuple[list[int], list[int]]:
    """The step's grid from its micro-batches' reports (`term_codes` of `size` parameters): per
    parameter the largest code, and how many reports hold it. The one merge of every side."""
    codes, counts = [ABSENT] * size, [0] * size
    for report in reports:
        for i, code in enumerate(report):
            codes[i] = max(codes[i], code)
            counts[i] += code != ABSENT
    return codes, counts


def grid_of(codes: Sequence[int], counts: Sequence[int], names: Sequence[str]) -> tuple[dict[str, int], set[str]]:
    """`merged_codes` by name: the grid's exponents, and the parameters a single term holds."""
    grid = {n: c - FIRST_EXPONENT + LOWEST_EXPONENT for n, c in zip(names, codes, strict=True) if c >= FIRST_EXPONENT}
    return grid, {n for n, k in zip(names, counts, strict=True) if k == 1}


def step_codes(terms: Terms, names: Sequence[str] | None = None):
    """`merged_codes` of `terms` over `names` (default: every parameter they hold, in order met); and the names."""
    if names is None:
        names = list(dict.fromkeys(name for term in terms for name, _ in term))
    return (*merged_codes((term_codes(term, names) for term in terms), len(names)), names)


def grid_exponents(terms: Terms) -> dict[str, int]:
    """Per parameter, the largest exponent over the micro-batches `terms` (a parameter whose
    gradients are all zeros gets none: its sum is zeros on any grid)."""
    return grid_of(*step_codes(terms))[0]


def term_counts(terms: Terms) -> dict[str, int]:
    """Per parameter, how many of `terms` hold a gradient of it. A sum of one term is that term, bit
    for bit (a step's gradients kept whole, as a checkpoint holds them, sum to themselves)."""
    _, counts, names = step_codes(terms)
    return dict(zip(names, counts, strict=True))


def pack_codes(codes: Sequence[int]) -> bytes:
    """Codes (or counts, below 2^16) on the wire: little-endian uint16s."""
    return struct.pack(f"<{len(codes)}H", *codes)


def unpack_codes(data: bytes, size: int, bound: int = FIRST_EXPONENT + BUCKETS) -> list[int] | None:
    """`pack_codes`'s inverse for `size` values below `bound`; None unless `data` is exactly that (a
    report that does not fit leaves the grid to the replicas' own round)."""
    if len(data) != 2 * size:
        return None
    values = list(struct.unpack(f"<{size}H", data))
    return values if all(v < bound for v in values) else None


def pack_grid(codes: Sequence[int], counts: Sequence[int]) -> bytes:
    """A step's grid for its replicas (`merged_codes`): the codes, then the counts."""
    return pack_codes([*codes, *counts])


def unpack_grid(data: bytes, size: int) -> tuple[list[int], list[int]] | None:
    """`pack_grid`'s inverse for `size` parameters; None unless `data` is one."""
    codes, counts = unpack_codes(data[: 2 * size], size), unpack_codes(data[2 * size :], size, MAX_TERMS + 1)
    return None if codes is None or counts is None else (codes, counts)


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


def integer_sums(terms: Terms, grid: dict[str, int], single: Collection[str] = ()) -> dict[str, torch.Tensor]:
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


def exact_sum(terms: Terms) -> dict[str, torch.Tensor]:
    """Parameter name -> the sum of its gradients over `terms`, in their dtype, the same bits in any order."""
    grid, single = grid_of(*step_codes(terms))
    like = {name: grad for term in terms for name, grad in term}  # each sum in its gradients' dtype and device
    return {
        name: (total if name in single else from_grid(total, grid.get(name), torch.float64)).to(
            like[name].device, like[name].dtype
        )
        for name, total in integer_sums(terms, grid, single).items()
    }


def exponent_counts(codes: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """A member's `merged_codes` as one-hot exponent rows (ZEROS and ABSENT: none) with its counts in
    a last column, which an all-reduce sums exactly: `codes_from_counts` of the sum is every
    member's codes merged, as `merged_codes` merges them."""
    rows = torch.zeros(len(codes), BUCKETS + 1, dtype=torch.float64)
    for row, (code, count) in enumerate(zip(codes, counts, strict=True)):
        if code >= FIRST_EXPONENT:
            rows[row, code - FIRST_EXPONENT] = 1.0
        rows[row, BUCKETS] = float(count)
    return rows.flatten()


def codes_from_counts(summed: torch.Tensor, size: int) -> tuple[list[int], list[int]]:
    """The merged codes and counts of `size` parameters in summed `exponent_counts`."""
    rows = summed.reshape(size, BUCKETS + 1)
    codes, counts = [], []
    for row in rows:
        present = torch.nonzero(row[:BUCKETS] > 0.5)
        count = round(float(row[BUCKETS]))
        codes.append(int(present.max()) + FIRST_EXPONENT if present.numel() else ZEROS if count else ABSENT)
        counts.append(count)
    return codes, counts


def grid_check(mine: Sequence[int], my_counts: Sequence[int], codes: Sequence[int]) -> torch.Tensor:
    """A member's check of a grid given (`codes`) against its own terms' (`mine`, `my_counts`), to
    add up in the integers' all-reduce: its counts, then per parameter 1 where its code is the
    grid's, MISFIT where it is above (its values would not fit), else 0."""
    verdicts = [0.0 if m == ABSENT or m < c else 1.0 if m == c else MISFIT for m, c in zip(mine, codes, strict=True)]
    return torch.tensor([*map(float, my_counts), *verdicts], dtype=torch.float64)


def grid_holds(summed: torch.Tensor, codes: Sequence[int], counts: Sequence[int]) -> bool:
    """Whether the members' summed `grid_check`s say the grid given is the step's: every count
    right, every exponent some member's and none above it (else the sums are redone on the step's)."""
    size = len(codes)
    total, verdicts = summed[:size].tolist(), summed[size:].tolist()
    for code, count, got, verdict in zip(codes, counts, total, verdicts, strict=True):
        if got != count or (verdict != 0 if code == ABSENT else not 1 <= verdict < MISFIT):
            return False
    return True


def recovered(mean_times_members: torch.Tensor, members: int) -> torch.Tensor:
    """An all-reduce's integer sum given back as a mean times its `members` (rounded at most a few
    float64 ulps of 2^46 off): the exact integers again. Raises ValueError past MAX_GROUP members."""
    if members > MAX_GROUP:
        raise ValueError(f"an exact sum takes at most {MAX_GROUP} replicas in a group, not {members}")
    return torch.round(mean_times_members)
