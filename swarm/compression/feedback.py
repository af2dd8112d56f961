"""The two ends of a compressed link direction, with optional error feedback.

A `Sender` turns a tensor into payload bytes; a `Receiver` turns the message the transport parsed
from them (`protocols.wire.decode`, with the transport's limits) back into a tensor, with the
link's codec (`Codec.decode`), or with `EXACT` for exact payloads. Stateful variants:

- `ef`      Seide EF, sender only: send C(x + e), keep e = (x + e) - C(x + e).
- `efmixed` EF for TopK: K/2 largest of x plus K/2 largest of e, sent from x + e.
- `ef21`    mirrored g on both ends: send C(x - g), both ends g += C(x - g), receiver outputs g.
- `aqsgd`   like ef21 with one buffer per sample id (AQ-SGD), stored compactly.

State changes only when the caller commits a message it knows was delivered (`commit()` on the
`Outgoing` / `Incoming`); mirrored payloads carry state versions, and a receiver whose state
differs raises `StateMismatchError` instead of silently diverging. A codec may keep link state of
its own (`Codec.link_state`: the subspace codec's basis, a warm low-rank sender's start); it
changes on the same commit (`Codec.delivered`) and is reset and checkpointed with the end's table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocols import wire
from protocols.errors import PayloadError
from protocols.message import Encoded, StateStamp
from protocols.wire import rows_of
from swarm.compression.codecs import EXACT, Codec, TopK, describe, is_exact, selection_of
from swarm.compression.state import GlobalState, SampleStore, StaleStateError
from swarm.compression.topk import Selection, kept_per_sample


class StateMismatchError(PayloadError):
    """The payload was computed against mirrored state this end does not have."""


@dataclass
class _Delivery:
    """Something whose state update waits for `commit()`; committing twice is a no-op."""

    _apply: Callable[[], None] | None = field(default=None, repr=False)

    def commit(self) -> None:
        apply, self._apply = self._apply, None
        if apply is not None:
            apply()


@dataclass
class Outgoing(_Delivery):
    payload: bytes = b""
    selection: Selection | None = None  # remembered for a reused-index reply


@dataclass
class Incoming(_Delivery):
    tensor: torch.Tensor | None = None
    selection: Selection | None = None


def _ids(sample_ids, rows: int) -> list[int]:
    if sample_ids is None:
        raise ValueError("per-sample error feedback needs the sample ids of the micro-batch")
    ids = [int(i) for i in (sample_ids.tolist() if torch.is_tensor(sample_ids) else sample_ids)]
    if len(ids) != rows:
        raise ValueError(f"got {len(ids)} sample ids for {rows} samples")
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids within a micro-batch must be distinct")
    return ids


def _then(first: Callable[[], None] | None, second: Callable[[], None] | None) -> Callable[[], None] | None:
    """Both state changes of one delivered message: the end's table, then its codec's link state."""
    if first is None or second is None:
        return first or second

    def apply() -> None:
        first()
        second()

    return apply


def _commit_if_current(table, shape, ids, based_on: tuple[int, ...], write: Callable[[], object]) -> Callable[[], None]:
    def apply() -> None:
        if table.versions(shape, ids) != based_on:
            raise StaleStateError("error-feedback state changed since this message was encoded")
        write()

    return apply


class Sender:
    """Plain codec, no state."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def _encode(
        self, x: torch.Tensor, sample_ids, reuse: Selection | None, warmup: bool
    ) -> tuple[Encoded, Callable | None]:
        return (EXACT if warmup else self.codec).encode(x, reuse), None

    def send(self, x: torch.Tensor, sample_ids=None, reuse: Selection | None = None, warmup: bool = False) -> Outgoing:
        """Encode x. `reuse`: the forward selection (topk:reuse); `warmup`: send exact values."""
        enc, apply = self._encode(x, sample_ids, reuse, warmup)
        apply = _then(apply, self.codec.delivered(enc))  # right after encoding: the state it saw
        payload = wire.encode(enc)
        return Outgoing(apply, payload, selection_of(enc))

    def send_stateless(self, x: torch.Tensor, exact: bool = False) -> Outgoing:
        """Encode with the plain codec (or exactly), touching no state: for evaluation."""
        return Outgoing(None, wire.encode((EXACT if exact else self.codec.standalone).encode(x)))

    def reset(self) -> None:
        """Forget all state (a new peer on the other end)."""
        _reset(self)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this end: its state table and its codec's link state, if any."""
        return _state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        _load_state_dict(self, state)

    @property
    def state_bytes(self) -> int:
        return _state_bytes(self)


class Receiver:
    """Plain codec, no state. Takes the message the transport parsed and checked (wire.decode)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def _codec(self, enc: Encoded) -> Codec:
        """Exact payloads (warmup, uncompressed evaluation) come on any link; the rest must be the link codec's."""
        return EXACT if is_exact(enc) else self.codec

    def _decode(
        self, enc: Encoded, sample_ids, reuse: Selection | None, device
    ) -> tuple[torch.Tensor, Callable | None]:
        return self._codec(enc).decode(enc, device, reuse), None

    def receive(self, enc: Encoded, sample_ids=None, reuse: Selection | None = None, device=None) -> Incoming:
        tensor, apply = self._decode(enc, sample_ids, reuse, device)
        apply = _then(apply, self._codec(enc).delivered(enc))  # right after decoding: the state it saw
        return Incoming(apply, tensor, selection_of(enc))

    def receive_stateless(self, enc: Encoded, device=None) -> Incoming:
        """Decode a stateless payload (evaluation): no versions, no state."""
        return Incoming(None, (EXACT if is_exact(enc) else self.codec.standalone).decode(enc, device))

    def reset(self) -> None:
        _reset(self)

    def state_dict(self) -> dict:
        return _state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        _load_state_dict(self, state)

    @property
    def state_bytes(self) -> int:
        return _state_bytes(self)


_STATE_NAMES = {"table": "error-feedback", "basis": "codec link"}
_LINK_STATE_NAMES = {"subspace": "subspace basis", "lowrank-warm": "low-rank warm start"}  # by kind


def _states(end) -> dict:
    """What an end keeps across messages, by checkpoint key: its error-feedback table, its codec's
    link state (both ends of a mirrored link keep theirs: the sender's counts too)."""
    states = {"table": getattr(end, "table", None), "basis": end.codec.link_state}
    return {key: state for key, state in states.items() if state is not None}


def _reset(end) -> None:  # both ends forget together (a new neighbour)
    for state in _states(end).values():
        state.reset()


def _state_bytes(end) -> int:
    return sum(state.nbytes for state in _states(end).values())


def _state_dict(end) -> dict:
    return {key: state.state_dict() for key, state in _states(end).items()}


def _load_state_dict(end, state: dict) -> None:
    states = _states(end)
    for key, name in _STATE_NAMES.items():
        if (key in states) != (key in state):
            got, have = ("a", "none") if key in state else ("no", "one")
            if key == "basis":  # the codec's link state, named by the kind the one side has
                kind = (state[key] if key in state else states[key].state_dict()).get("kind")
                name = _LINK_STATE_NAMES.get(kind, name)
            raise ValueError(
                f"checkpoint has {got} {name} state, this {type(end).__name__} keeps {have} (was the compression spec changed?)"
            )
    for key, table in states.items():
        table.load_state_dict(state[key])


def _table(per_sample: bool, store: str, path, capacity):
    return SampleStore(store, path, capacity) if per_sample else GlobalState()


class ErrorFeedbackSender(Sender):
    """Seide EF (and EF-mixed for TopK): the error buffer lives on the sender only."""

    def __init__(
        self, codec: Codec, per_sample: bool = False, mixed: bool = False, store: str = "fp32", path=None, capacity=None
    ) -> None:
        super().__init__(codec)
        if mixed and not isinstance(codec, TopK):
            raise ValueError("efmixed needs a topk codec")
        self.per_sample = per_sample
        self.mixed = mixed
        self.table = _table(per_sample, store, path, capacity)

    def _mixed_positions(self, x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows = rows_of(tuple(x.shape))
        per_sample = x.numel() // rows if rows else 0
        k = kept_per_sample(self.codec.ratio, per_sample)
        from_input = (k + 1) // 2
        mask = torch.zeros((rows, per_sample), dtype=torch.bool, device=x.device)
        if from_input:
            mask.scatter_(
                1, torch.topk(x.detach().reshape(rows, -1).abs(), from_input, dim=1, sorted=False).indices, True
            )
        if k - from_input:
            scores = error.reshape(rows, -1).abs().masked_fill_(mask, -1.0)
            mask.scatter_(1, torch.topk(scores, k - from_input, dim=1, sorted=False).indices, True)
        return mask.view(-1).nonzero().squeeze(1), k

    def _encode(self, x, sample_ids, reuse, warmup):
        shape = tuple(x.shape)
        ids = _ids(sample_ids, rows_of(shape)) if self.per_sample else None
        error, versions = self.table.load(shape, ids, x.device)
        if warmup:  # exact values leave no error
            return EXACT.encode(x), _commit_if_current(
                self.table,
                shape,
                ids,
                versions,
                lambda: self.table.save(ids, torch.zeros_like(error), tuple(v + 1 for v in versions)),
            )
        corrected = error.add_(x.detach())
        if self.mixed:
            positions, k = self._mixed_positions(x, corrected - x.detach())
            enc = self.codec.encode_at(corrected, positions, k)
        else:
            enc = self.codec.encode(corrected, reuse)
        enc.dtype = x.dtype
        residual = corrected - self.codec.decode(enc, x.device, reuse).float()
        new_versions = tuple(v + 1 for v in versions)
        return enc, _commit_if_current(
            self.table, shape, ids, versions, lambda: self.table.save(ids, residual, new_versions)
        )


class _Mirrored:
    """Shared by both ends of EF21 / AQ-SGD: the state table and the stamp check."""

    def _setup(self, per_sample: bool, store: str, path, capacity) -> None:
        self.per_sample = per_sample
        self.table = _table(per_sample, store, path, capacity)

    def _stamp(self, versions: tuple[int, ...], warmup: bool) -> StateStamp:
        if self.per_sample:
            return StateStamp(sample_versions=versions, warmup=warmup)
        return StateStamp(version=versions[0], warmup=warmup)

    def _keys(self, shape, sample_ids):
        return _ids(sample_ids, rows_of(shape)) if self.per_sample else None


class _ReceiverKeys:
    """A receiver checks the payload against the micro-batch's ids: a mismatch is a bad payload."""

    def _keys(self, shape, sample_ids):
        try:
            return super()._keys(shape, sample_ids)
        except ValueError as e:
            raise PayloadError(f"payload does not fit the micro-batch: {e}") from None


class MirroredSender(_Mirrored, Sender):
    """EF21 (global g) or AQ-SGD (per-sample m): send C(x - m), then m += C(x - m)."""

    def __init__(self, codec: Codec, per_sample: bool, store: str = "fp32", path=None, capacity=None) -> None:
        Sender.__init__(self, codec)
        self._setup(per_sample, store, path, capacity)

    def _encode(self, x, sample_ids, reuse, warmup):
        shape = tuple(x.shape)
        ids = self._keys(shape, sample_ids)
        state, versions = self.table.load(shape, ids, x.device)
        if warmup:  # AQ-SGD warmup: exact values fill the buffers on both ends
            enc = EXACT.encode(x)
            updated = x.detach().to(torch.float32, copy=True)  # the caller may change x before commit
        else:
            enc = self.codec.encode(x.detach().float() - state, reuse)
            enc.dtype = x.dtype
            updated = state.add_(self.codec.decode(enc, x.device, reuse).float())
        enc.stamp = self._stamp(versions, warmup)
        new_versions = tuple(v + 1 for v in versions)
        return enc, _commit_if_current(
            self.table, shape, ids, versions, lambda: self.table.save(ids, updated, new_versions)
        )


class MirroredReceiver(_ReceiverKeys, _Mirrored, Receiver):
    def __init__(self, codec: Codec, per_sample: bool, store: str = "fp32", path=None, capacity=None) -> None:
        Receiver.__init__(self, codec)
        self._setup(per_sample, store, path, capacity)

    def _decode(self, enc, sample_ids, reuse, device):
        ids = self._keys(enc.shape, sample_ids)
        state, versions = self.table.load(enc.shape, ids, device)
        stamp = enc.stamp
        if stamp is None:
            raise StateMismatchError("payload carries no state version, but this link keeps mirrored state")
        theirs = stamp.sample_versions if self.per_sample else (stamp.version,)
        if tuple(theirs) != versions:
            raise StateMismatchError(
                f"mirrored state versions differ: sender {tuple(theirs)[:4]}, receiver {versions[:4]}"
            )
        if stamp.warmup:  # the sender's buffers take exact values (MirroredSender): so must ours
            if not is_exact(enc):
                raise PayloadError(f"a warmup payload of {describe(enc)} values, not exact ones")
            updated = EXACT.decode(enc, device).float()
        else:  # a difference C(x - m) in the link's codec: nothing else was computed against m
            updated = state.add_(self.codec.decode(enc, device, reuse).float())
        new_versions = tuple(v + 1 for v in versions)
        out = updated.to(enc.dtype, copy=True)  # the caller may change the output before commit
        return out, _commit_if_current(
            self.table, enc.shape, ids, versions, lambda: self.table.save(ids, updated, new_versions)
        )
