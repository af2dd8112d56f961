"""One stage's half of a boundary with one neighbour peer.

The upstream half sends activations and receives gradients; the downstream half receives
activations and sends gradients. Each half keeps the compression state of its ends (keyed by the
neighbour, so a new neighbour starts fresh), the forward TopK selections that reused-index
gradients need, and byte counters.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from protocols.message import Encoded
from swarm.compression.spec import CompressionSpec, parse
from swarm.compression.topk import Selection
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.tracing import TRACER

FORWARD, BACKWARD = "forward", "backward"


class LinkEnd:
    def __init__(
        self,
        boundary: int,
        upstream: bool,
        forward: str,
        backward: str,
        store_dir: str | None = None,
        capacity: int | None = None,
    ) -> None:
        self.boundary = boundary
        self.upstream = upstream
        self.forward_spec: CompressionSpec = parse(forward)
        self.backward_spec: CompressionSpec = parse(backward)
        store = None if store_dir is None else f"{store_dir}/boundary{boundary}-{'up' if upstream else 'down'}"
        if upstream:
            self.sender = self.forward_spec.sender(f"{store}-forward.npy" if store else None, capacity)
            self.receiver = self.backward_spec.receiver(f"{store}-backward.npy" if store else None, capacity)
        else:
            self.receiver = self.forward_spec.receiver(f"{store}-forward.npy" if store else None, capacity)
            self.sender = self.backward_spec.sender(f"{store}-backward.npy" if store else None, capacity)
        self.selections: dict[tuple, Selection] = {}
        self.bytes = Counter()  # (mode, direction) -> bytes sent by this half
        self.raw = Counter()  # (mode, direction) -> bytes those tensors had uncompressed (the compression ratio)

    @property
    def _send_direction(self) -> str:
        return FORWARD if self.upstream else BACKWARD

    def send(self, batch: MicroBatch, tensor: torch.Tensor):
        """Encode for the neighbour; returns the Outgoing (commit it once delivered)."""
        with TRACER.span("encode", "compute", mb=batch.label):
            if batch.mode is Mode.EVAL:
                out = self.sender.send_stateless(tensor, exact=batch.exact)
            else:
                reuse = None if self.upstream else self.selections.pop(batch.key, None)
                out = self.sender.send(tensor, batch.sample_ids, reuse=reuse, warmup=batch.exact)
                if self.upstream and out.selection is not None:
                    self.selections[batch.key] = out.selection
        key = (batch.mode.value, self._send_direction)
        self.bytes[key] += len(out.payload)
        self.raw[key] += tensor.numel() * tensor.element_size()
        return out

    def receive(self, batch: MicroBatch, payload: Encoded, device):
        """Decode the neighbour's message (the transport parsed it: protocols.wire.decode); returns
        the Incoming (commit it once processed)."""
        with TRACER.span("decode", "compute", mb=batch.label):
            if batch.mode is Mode.EVAL:
                return self.receiver.receive_stateless(payload, device=device)
            reuse = self.selections.pop(batch.key, None) if self.upstream else None
            incoming = self.receiver.receive(payload, batch.sample_ids, reuse=reuse, device=device)
        if not self.upstream and incoming.selection is not None:
            self.selections[batch.key] = incoming.selection
        return incoming

    def forget(self, batch: MicroBatch) -> None:
        """Drop what a failed micro-batch left behind."""
        self.selections.pop(batch.key, None)

    def reset(self) -> None:
        """A new neighbour: mirrored state starts fresh on both ends."""
        self.sender.reset()
        self.receiver.reset()
        self.selections.clear()

    def state_dict(self) -> dict:
        """Compression state of both ends and the byte counters; only between micro-batches."""
        if self.selections:
            raise RuntimeError(
                f"boundary {self.boundary} has {len(self.selections)} micro-batch(es) in flight; checkpoint between steps"
            )
        return {
            "boundary": self.boundary,
            "upstream": self.upstream,
            "specs": [self.forward_spec.text, self.backward_spec.text],
            "sender": self.sender.state_dict(),
            "receiver": self.receiver.state_dict(),
            "bytes": [[mode, direction, int(n)] for (mode, direction), n in self.bytes.items()],
            "raw": [[mode, direction, int(n)] for (mode, direction), n in self.raw.items()],
        }

    def check_state(self, state: dict) -> None:
        """Raises ValueError if `state` is not of a link end like this one (boundary, side, codecs)."""
        mine = (self.boundary, self.upstream, [self.forward_spec.text, self.backward_spec.text])
        theirs = (state["boundary"], state["upstream"], list(state["specs"]))
        if mine != theirs:
            raise ValueError(f"checkpoint is for link end (boundary, upstream, specs) {theirs}, this one is {mine}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.sender.load_state_dict(state["sender"])
        self.receiver.load_state_dict(state["receiver"])
        self.selections.clear()
        self.bytes = Counter({(mode, direction): n for mode, direction, n in state["bytes"]})
        self.raw = Counter({(mode, direction): n for mode, direction, n in state.get("raw", [])})

    @property
    def state_bytes(self) -> int:
        return self.sender.state_bytes + self.receiver.state_bytes


class LinkEnds(NamedTuple):
    """The link ends a stage computes with: `inbound` on the boundary before it (activations in,
    gradients out; None for stage 0), `outbound` on the one after it (None for the last stage).
    The transport picks them per call: one pair for good in one process, the ends of the
    neighbour peers of this micro-batch in a swarm."""

    inbound: LinkEnd | None
    outbound: LinkEnd | None

    def state_bytes(self) -> int:
        return sum(end.state_bytes for end in self if end is not None)
