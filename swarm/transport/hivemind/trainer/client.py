"""The trainer's side of a call: a typed stub's request (protocols.stubs) sent to one stage peer.

The kind travels with the head the stub built, so no call site names a kind by its string; a call
only the run's owner makes is signed with `owner`'s key (protocols.calls says which)."""

from __future__ import annotations

from protocols.framing import Frame
from protocols.stubs import Request
from swarm.transport.hivemind.net.calls import call
from swarm.transport.hivemind.net.streams import StreamPool


async def ask(
    streams: StreamPool, peer_id: str, request: Request, timeout: float, payload: bytes = b"", owner=None
) -> Frame:
    """`request` (and its `payload`) to `peer_id` and its verified reply, within `timeout` s."""
    return await call(streams, peer_id, request.kind, request.head, payload, timeout, owner)
