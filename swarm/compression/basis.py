"""The subspace codec's link state: the basis both ends of a link hold, kept in step by messages.

Mirrored like EF21's buffers (`swarm.compression.feedback`), with the same guarantees:
- versions: every basis a link installs has the next version (1 for the first, after a reset too);
  a message names the version its coefficients are in, or, carrying a basis, the version that basis
  becomes. An end holding another version refuses it with `StateMismatchError` (one line; the
  transport restarts the link), so the ends never decode in different bases silently;
- commit on delivery: a message changes the state only when the caller commits its `Outgoing` /
  `Incoming` (`Codec.delivered`), once, and only if the state is still the one it was encoded or
  decoded against (`StaleStateError` otherwise): a failed or retried micro-batch commits nothing;
- both ends count delivered messages, so their states (basis, version, count) are equal, and the
  sender refreshes after `every` messages, or when a tensor could fill a basis of higher rank
  than the held one (a first micro-batch smaller than the rank);
- `reset()` for a new neighbour, `state_dict()` / `load_state_dict()` for checkpoints, copies and
  recovery, `nbytes` for the state's size.

One basis per last dimension (`cols`): micro-batches of other lengths share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocols.errors import PayloadError
from protocols.message import Encoded, SubspacePart
from protocols.wire import matrix_of
from swarm.compression.codecs import Codec
from swarm.compression.feedback import StateMismatchError
from swarm.compression.state import StaleStateError
from swarm.compression.subspace import Subspace


@dataclass
class Held:
    """A basis an end installed: [rank, cols] float32 on the CPU, its version, and how many
    delivered messages it has served (the one that carried it included)."""

    vectors: torch.Tensor
    version: int
    sent: int = 1

    @property
    def rank(self) -> int:
        return self.vectors.shape[0]


class BasisState:
    """The bases of one link end, by last dimension."""

    KIND = "subspace"  # a checkpoint's name for this state: loading refuses another kind
    WHAT = "a subspace basis"

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}

    def held(self, cols: int) -> Held | None:
        return self._held.get(cols)

    def stamp(self, cols: int) -> tuple[int, int]:
        """(version, messages served) of the basis for `cols`; (0, 0) without one."""
        held = self._held.get(cols)
        return (0, 0) if held is None else (held.version, held.sent)

    def install(self, cols: int, vectors: torch.Tensor, version: int) -> None:
        self._held[cols] = Held(vectors.detach().to("cpu", torch.float32, copy=True), version)

    def count(self, cols: int) -> None:
        self._held[cols].sent += 1

    def reset(self) -> None:
        self._held.clear()

    def state_dict(self) -> dict:
        return {
            "kind": self.KIND,
            "bases": [
                {"cols": cols, "vectors": h.vectors.clone(), "version": h.version, "sent": h.sent}
                for cols, h in self._held.items()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.KIND:
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} state, this link end keeps {self.WHAT}")
        self._held = {
            int(b["cols"]): Held(b["vectors"].float().clone(), int(b["version"]), int(b["sent"]))
            for b in state["bases"]
        }

    @property
    def nbytes(self) -> int:
        return sum(h.vectors.numel() * h.vectors.element_size() for h in self._held.values())


def _held_text(held: Held | None) -> str:
    return "none" if held is None else f"basis {held.version}"


class LinkSubspace(Codec):
    """A `Subspace` codec bound to one link end's `BasisState`: what senders and receivers use."""

    def __init__(self, plain: Subspace) -> None:
        self.plain = plain
        self.link_state = BasisState()

    @property
    def spec(self) -> str:
        return self.plain.spec

    @property
    def standalone(self) -> Subspace:
        return self.plain

    def _refreshes(self, held: Held | None, rank: int) -> bool:
        return held is None or held.sent >= self.plain.every or held.rank < rank

    def encode(self, x: torch.Tensor, reuse=None) -> Encoded:
        rank = self.plain.rank_for(tuple(x.shape))
        if rank == 0:  # an empty matrix: a standalone message, nothing to keep in step
            return self.plain.encode(x)
        m = self.plain.matrix(x)
        held = self.link_state.held(m.shape[1])
        if self._refreshes(held, rank):
            part, basis = self.plain.fresh_basis(m, rank)
            return self.plain.message(x, m, basis, (0 if held is None else held.version) + 1, part)
        return self.plain.message(x, m, held.vectors.to(m.device), held.version)

    def _basis_of(self, enc: Encoded, device) -> torch.Tensor:
        """The basis `enc` is in: the one it carries, or the one this end holds, if the versions agree."""
        part: SubspacePart = enc.body
        cols = matrix_of(enc.shape)[1]
        held = self.link_state.held(cols)
        if part.basis is not None:
            mine = 0 if held is None else held.version
            if part.basis_version != mine + 1:
                raise StateMismatchError(
                    f"subspace basis versions differ: the payload installs basis {part.basis_version}, this end holds {_held_text(held)}"
                )
            return self.plain.read_basis(part.basis, part.rank, cols, device)
        if held is None or held.version != part.basis_version:
            raise StateMismatchError(
                f"subspace basis versions differ: the payload is in basis {part.basis_version}, this end holds {_held_text(held)}"
            )
        if held.rank != part.rank:
            raise PayloadError(f"a rank-{part.rank} subspace payload in basis {held.version} of rank {held.rank}")
        return held.vectors

    def decode(self, enc: Encoded, device=None, reuse=None) -> torch.Tensor:
        if not self.plain.holds(enc):
            raise self._refuse(enc)
        if enc.body.basis_version == 0:
            return self.plain.decode(enc, device)
        return self.plain.reconstruct(enc, self._basis_of(enc, device), device)

    def delivered(self, enc: Encoded) -> Callable[[], None] | None:
        part = enc.body
        if not isinstance(part, SubspacePart) or part.basis_version == 0:
            return None
        cols = matrix_of(enc.shape)[1]
        seen = self.link_state.stamp(cols)  # called right after encode / decode: the state they used
        # both ends install the basis read from the message's values, the sender too: bit-identical
        vectors = None if part.basis is None else self.plain.read_basis(part.basis, part.rank, cols)

        def apply() -> None:
            if self.link_state.stamp(cols) != seen:
                raise StaleStateError("the subspace basis changed since this message was encoded")
            if vectors is None:
                self.link_state.count(cols)
            else:
                self.link_state.install(cols, vectors, part.basis_version)

        return apply
