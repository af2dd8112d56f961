"""The swarm's copies on a slow link: a holder's fetch of a neighbour stage's copy leaves at a small
share of the sender's declared uplink, below the training's payloads.

A copy of an asynchronous stage holds its weights, the optimizers' state, the kept step's gradient
and the look-ahead's last move, about four times the weights; sent at once every few steps over
the link that carries the stage's activations, it took more of that link than the payloads did
(docs/bench/time-to-target.md). Sent at `COPY_SHARE` of the uplink it costs the payloads at most
that share, and the trainer spaces its snapshot rounds by how long the last round's copies take
to arrive (swarm.transport.hivemind.trainer.recovery), so a copy is never sent twice at once. A
restore's download is not paced: the run waits for it. A peer with no declared uplink does not
pace (its copies go at once, as before).
"""

from __future__ import annotations

from swarm.netlab.shaper import TokenBucket
from swarm.transport.hivemind.flow.pacing import PAYLOAD_SHARE, piece_bytes

COPY_SHARE = 0.05  # of the declared uplink: what the copies cost the training's payloads at most


class CopyFlow:
    """The copies this peer sends to holders: one bucket at `COPY_SHARE` of its uplink (what
    flow.pacing.send_paced asks of a flow: the next piece's size, and waiting for it)."""

    def __init__(self, uplink_bits: float) -> None:
        self.rate_bits = uplink_bits * PAYLOAD_SHARE * COPY_SHARE
        self.bucket = TokenBucket(self.rate_bits, burst_bytes=piece_bytes(self.rate_bits))

    def next_piece(self) -> int:
        return self.bucket.burst_bytes

    async def piece(self, nbytes: int) -> None:
        await self.bucket.consume(nbytes)


def copy_flow(uplink_bits: float | None) -> CopyFlow | None:
    """The copies' flow of a peer with `uplink_bits` declared, or None (unpaced)."""
    return CopyFlow(uplink_bits) if uplink_bits else None
