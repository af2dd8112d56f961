"""The replicas' exact sum of a stage's held gradients (swarm.engine.exactsum): the same bits
whatever micro-batches each replica ran, as one process's.

Every member puts its micro-batches' gradients on the step's grid and the group all-reduces the
integers. The grid comes with the group (`AverageGroup.grid`): the trainer merged it from the
exponents each micro-batch's peers reported with its result, as one process merges its terms', so
the members sum at once, without a round trip of their own. The same all-reduce checks it: each
member adds its counts and whether its own exponents meet the grid (`grid_check`); a grid that is
not the step's (a report of gradients other than those summed) is found alike by every member, which
then agree on the grid in a round of their own (GRID_ROUND, today's way without a grid given) and
sum again (REDO). A joiner catching up contributes nothing and takes the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from protocols import stage_pb2 as pb
from swarm.engine.exactsum import (
    codes_from_counts,
    exponent_counts,
    from_grid,
    grid_check,
    grid_holds,
    grid_of,
    unpack_grid,
)
from swarm.transport.hivemind.stage.state import StageState

GRID_ROUND = b"/grid"  # the id suffix of a replicas group's round that agrees on the step's grid
REDO = b"/redo"  # ... and of its integers' round after a grid given did not hold
ROUNDS = (GRID_ROUND, REDO)  # a member that refuses the group refuses these too


class Summing(Protocol):
    """What a replicas' sum runs on (stage.combine's Combining): the stage, its computing thread
    (`before_sums`: a failure there refuses the groups) and its all-reduces (`sum`)."""

    state: StageState

    async def before_sums(self, groups, fn, *args): ...

    async def sum(self, group: pb.AverageGroup, tensors: list, round_id: bytes = b"", integers=()) -> list: ...


@dataclass
class ReplicaSum:
    """One exact sum of `names` (in module order) with the replicas `group`, over the held gradients
    `keys`; `combining` (stage.combine) runs the computing and the all-reduces, `refused` are the
    groups a failure on the computing thread leaves."""

    combining: Summing
    group: pb.AverageGroup
    names: list[str]
    keys: list[tuple]
    refused: list

    async def run(self) -> dict[str, torch.Tensor]:
        """The sum by name, in the parameters' dtype."""
        combining, size = self.combining, len(self.names)
        runtime = combining.state.runtime
        contributes = combining.state.joining is None
        mine = ([0] * size, [0] * size)
        if contributes:
            mine = await combining.before_sums(self.refused, runtime.held_codes, self.keys, self.names)
        given = unpack_grid(self.group.grid, size) if self.group.grid else None
        if given is not None:  # every member has the same group, so all take the same path
            sums = await self._on_grid(given, mine, b"")
            if sums is not None:
                return sums
        (summed,) = await combining.sum(self.group, [exponent_counts(*mine)], GRID_ROUND, [True])
        return await self._on_grid(codes_from_counts(summed, size), None, REDO if given is not None else b"")

    async def _on_grid(self, grid: tuple[list[int], list[int]], mine, round_id: bytes):
        """The members' integers on `grid` (codes, counts) summed; with `mine` (this member's codes
        and counts), checked in the same all-reduce: None when the grid is not the step's."""
        combining, names = self.combining, self.names
        runtime = combining.state.runtime
        exponents, single = grid_of(*grid, names)
        integers = {}
        if combining.state.joining is None:
            integers = await combining.before_sums(self.refused, runtime.held_integers, self.keys, exponents, single)
        packed = [integers.get(name, torch.zeros(runtime.parameter(name).shape, dtype=torch.float64)) for name in names]
        flags = [torch.tensor([float(name in integers) for name in names])]
        if mine is not None:
            flags.append(grid_check(*mine, grid[0]))
        summed = await combining.sum(
            self.group, [*packed, *flags], round_id, [name not in single for name in names] + [True] * len(flags)
        )
        if mine is not None and not grid_holds(summed[-1], *grid):
            return None
        present = summed[len(names)].tolist()
        dtypes = {name: runtime.parameter(name).dtype for name in names}
        return {
            name: t.to(dtypes[name]) if name in single else from_grid(t, exponents.get(name), dtypes[name])
            for name, t, there in zip(names, summed, present, strict=False)
            if there > 0
        }
