"""`lowrank:R/warm`: a link's sender starts each message's range finder where the last one ended.

PowerSGD's warm start, per link: the sender keeps, per last dimension (cols), the directions of
the right factor of the last DELIVERED message (orthonormal rows [rank, cols], float32, on the
CPU), and the next message's range finder starts from them instead of the fixed sketch's first
columns (the sketch's other columns still oversample) and runs `WARM_ITERATIONS` power iterations
instead of `ITERATIONS`: two products with the matrix fewer per message, and on activations whose
top subspace drifts slowly between micro-batches, a start already near it that one round sharpens
as far as two rounds sharpen a random one (tests/compression/test_lowrank_warm.py).

Only the sender keeps state: the message is an ordinary low-rank payload (the wire format is
unchanged), which any `lowrank:R` receiver decodes as it always has. The directions are read
back from the message's own right factor (its bytes, as the receiver would read them), so the
state is a function of the delivered messages alone. It is link state as a subspace basis is
(`swarm.compression.basis`, whose per-cols table it reuses): it changes only when the caller
commits a delivered message (`Codec.delivered`), once, and only if it is still the state the
message was encoded from (`StaleStateError` otherwise: a failed or retried micro-batch commits
nothing); `reset()` for a new neighbour, `state_dict()` (kind "lowrank-warm") for checkpoints,
copies and recovery, `nbytes` for its size. Micro-batches cross a link in the trainer's order in
both transports, so a swarm's senders hold the states one process's do and send the same bytes.
A link's first message of a last dimension (after a reset too) starts cold: its bytes are plain
`lowrank:R`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from protocols.message import Encoded, LowRankPart
from protocols.wire import matrix_of
from swarm.compression.basis import BasisState
from swarm.compression.codecs import Codec
from swarm.compression.lowrank import LowRank
from swarm.compression.state import StaleStateError


class WarmStart(BasisState):
    """The directions one link's sender starts its next message from, by last dimension (the
    held `vectors`; `version` counts installs, so a commit sees whether another came first)."""

    KIND = "lowrank-warm"
    WHAT = "a low-rank warm start"


def directions(right: torch.Tensor) -> torch.Tensor:
    """Orthonormal rows [rank, cols] spanning a right factor's rows, in their order (the factor's
    rows are orthogonal already, scaled by the root of their singular values: QR keeps each
    row's direction, the top first)."""
    return torch.linalg.qr(right.T, mode="reduced").Q.T


class WarmLowRank(Codec):
    """A `LowRank` codec bound to one link sender's `WarmStart`: what a `/warm` sender runs."""

    def __init__(self, plain: LowRank) -> None:
        self.plain = plain
        self.link_state = WarmStart()

    @property
    def spec(self) -> str:
        return self.plain.spec

    @property
    def standalone(self) -> LowRank:
        return self.plain

    def encode(self, x: torch.Tensor, reuse=None) -> Encoded:
        held = self.link_state.held(matrix_of(tuple(x.shape))[1])
        return self.plain.message(x, None if held is None else held.vectors)

    def decode(self, enc: Encoded, device=None, reuse=None) -> torch.Tensor:
        return self.plain.decode(enc, device)  # the sender's own error feedback: a plain message

    def delivered(self, enc: Encoded) -> Callable[[], None] | None:
        part = enc.body
        if not isinstance(part, LowRankPart) or part.rank == 0:  # exact (warmup) or empty: no directions
            return None
        cols = matrix_of(enc.shape)[1]
        seen = self.link_state.stamp(cols)  # called right after encode: the state it started from
        found = directions(self.plain.right_factor(enc))

        def apply() -> None:
            if self.link_state.stamp(cols) != seen:
                raise StaleStateError("the low-rank warm start changed since this message was encoded")
            self.link_state.install(cols, found, seen[0] + 1)

        return apply
