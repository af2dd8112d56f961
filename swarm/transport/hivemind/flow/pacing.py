"""Per-flow pacing: each neighbour's payloads leave at that flow's share of the two links it crosses.

A middle stage sends activations down and gradients up over one upload link and receives both
over one download link. On FIFO links (a home router, a tbf qdisc) TCP gives a flow that crosses
two busy links (stage 1 to stage 2: stage 1's upload, stage 2's download) much less than its fair
share, while flows crossing one busy link take the rest; the starved middle flows then hold up the
whole pipeline (docs/bench/README.md, "Pacing"). When a peer declares its link rates (`--uplink`,
`--downlink`), it paces what it sends to each neighbour at

    min(its upload * this payload's share of the payloads being written, what the receiver offers)

times the share of wire bytes that is payload (libp2p, TLS and TCP framing take the rest). A
receiver offers a sender its download rate while its other incoming flow is idle, and while it is
active the sender's share of the two flows' latest payload sizes (half until both sizes are
known): a stage offers its upstream neighbour that share while it waits for gradients from
downstream, and its downstream neighbour its share while more activations of the step are still to
come from upstream. Offers travel with the data (every reply head offers the caller, every
micro-batch head offers the callee what it sends back), so the fill and the drain of a step run at
the full rate and the steady state at the shares; before the first offer, the stage record's
static share is used.

Shares follow payload sizes, not flow counts, because the two waves are rarely the same size
(TopK activations carry their indices, the reused-index gradients do not): with equal halves the
larger wave falls behind while the smaller one waits for it; with shares by size concurrent
payloads finish together (the fluid model, swarm.bench.fluid, shows the difference).

Payloads are written in pieces of about `PIECE_S` at the flow's rate under the flow's token
bucket; the protocol keeps its 1 MiB chunks (smaller chunks cost CPU per byte). Whole chunks are
too bursty to pace, and a fixed piece larger than a slow link's queue (a tbf qdisc holds a few
milliseconds) overflows it; each piece costs a write and a wake-up in the peer and in both
daemons, hence the bounds on the piece size. A peer with nothing declared does not pace. The
trainer paces the inputs it sends stage 0 too (with a declared uplink), but stage 0's offers do
not count that flow (its inputs are small).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter

from hivemind.p2p import P2P

from swarm.netlab.delayline import DelayLine
from swarm.netlab.shaper import TokenBucket

PAYLOAD_SHARE = 0.94  # payload bits per wire bit: what hivemind streams carry over a shaped link (docs/bench)
PIECE_BYTES = 1 << 18  # most written under the bucket at once: ~10 ms at 200 Mbit/s
MIN_OFFER_BITS = 64_000.0  # the slowest rate a neighbour's offer can set (a modem's): offers below it count as it
PIECE_S = 0.01  # a piece leaves in about this long at the flow's rate
MIN_PIECE_BYTES = 1 << 13  # below this, per-write costs grow and the links are slow anyway
MIN_WEIGHT_BYTES = 1 << 16  # what a payload weighs at least in the shares (payload_weight)


def piece_bytes(rate_bits: float) -> int:
    """How much of a payload to write at once at `rate_bits`: ~`PIECE_S` worth, so that a slow link's
    queue (tbf's is 64 KB at 10 Mbit/s) never receives a burst larger than it holds."""
    return int(min(PIECE_BYTES, max(MIN_PIECE_BYTES, rate_bits / 8 * PIECE_S)))


def payload_weight(nbytes: int) -> int:
    """A payload's weight in the shares of a link: its size, and at least `MIN_WEIGHT_BYTES`, so that
    a reply of a few hundred bytes beside a large payload does not crawl at a sliver of the rate."""
    return max(int(nbytes), MIN_WEIGHT_BYTES)


def carrying(flow: Flow | None, nbytes: int):
    """`flow.carrying(nbytes)`, or nothing to mark when the payload is not paced (`flow` None)."""
    return flow.carrying(nbytes) if flow is not None else contextlib.nullcontext()


def stage_flows(stage: int, num_stages: int) -> int:
    """Bulk flows a stage peer has each way: activations and gradients to and from each neighbour stage."""
    return int(stage > 0) + int(stage < num_stages - 1)


class Flow:
    """The payloads to one neighbour: one bucket; `carrying(nbytes)` marks a payload being written."""

    def __init__(self, pacer: FlowPacer, peer_id: str) -> None:
        self.pacer, self.peer_id = pacer, peer_id
        rate = pacer.rate(peer_id) or 1
        self.bucket = TokenBucket(rate, burst_bytes=piece_bytes(rate))

    @contextlib.contextmanager
    def carrying(self, nbytes: int):
        """While a payload of `nbytes` is written: it weighs that much in the upload's shares."""
        weight = payload_weight(nbytes)
        self.pacer._sending[self.peer_id] += weight
        try:
            yield self
        finally:
            self.pacer._sending[self.peer_id] -= weight

    def next_piece(self) -> int:
        """Bytes to write next, at the flow's current rate (its bucket follows the rate). A flow is
        made only for a paced neighbour, and offers and the uplink never go away, so it stays paced."""
        rate = self.pacer.rate(self.peer_id)
        if self.bucket.rate_bits != int(rate):
            self.bucket.set_rate(rate, burst_bytes=piece_bytes(rate))
        return self.bucket.burst_bytes

    async def piece(self, nbytes: int) -> None:
        """Waits until `nbytes` more may leave at the rate `next_piece` set."""
        await self.bucket.consume(nbytes)


class FlowPacer:
    """One peer's pacing: its declared link rates (bits/s; None: not declared) and a `Flow` per neighbour."""

    def __init__(self, uplink_bits: float | None, downlink_bits: float | None, flows: int) -> None:
        self.uplink = uplink_bits * PAYLOAD_SHARE if uplink_bits else None
        self.downlink = downlink_bits * PAYLOAD_SHARE if downlink_bits else None
        self.download_share = self.downlink / max(flows, 1) if self.downlink else 0.0  # static: the stage record's
        self._offered: dict[str, float] = {}  # neighbour -> payload bits/s it last offered us
        self._sending: Counter = Counter()  # neighbour -> bytes of the payloads being written to it
        self._arrived: dict[str, int] = {}  # neighbour -> bytes of its latest payload to us, latest last
        self._flows: dict[str, Flow] = {}

    def arrived(self, peer_id: str, nbytes: int) -> None:
        """A payload from a neighbour: its size sets that flow's share of our download."""
        self._arrived.pop(peer_id, None)
        self._arrived[peer_id] = payload_weight(nbytes)

    def offer(self, peer_id: str, other_active: bool) -> float:
        """What `peer_id` may send us now (0: not declared): all of the download, or while our other
        incoming flow is active its share by the two flows' latest payload sizes."""
        if not self.downlink:
            return 0.0
        if not other_active:
            return self.downlink
        mine = self._arrived.get(peer_id)
        other = next((n for peer, n in reversed(self._arrived.items()) if peer != peer_id), None)
        if not mine or not other:
            return self.downlink / 2
        return self.downlink * mine / (mine + other)

    def heard(self, peer_id: str, offered: float, fallback: bool = False) -> None:
        """A neighbour's offer from a head or a reply (0 says nothing); `fallback`: its record's
        static share, used only until it offers something. An offer that is not a rate (infinite,
        not a number) says nothing; one below MIN_OFFER_BITS counts as that much, so no neighbour can
        make this peer hold a sending slot for ever."""
        if not math.isfinite(offered):
            return
        if offered > 0 and not (fallback and peer_id in self._offered):
            self._offered[peer_id] = max(offered, MIN_OFFER_BITS)

    def rate(self, peer_id: str) -> float | None:
        """Payload bits/s for the next bytes to `peer_id`; None: not paced."""
        known = [self._offered.get(peer_id)]
        if self.uplink:
            others = [n for peer, n in self._sending.items() if peer != peer_id and n > 0]
            mine = self._sending[peer_id] or max(others, default=1)  # not yet marked: an equal share
            known.append(self.uplink * mine / (mine + sum(others)))
        known = [r for r in known if r]
        return min(known) if known else None

    def flow(self, peer_id: str) -> Flow | None:
        """The flow to `peer_id` (shared by its payloads in transfer), or None when nothing is declared."""
        if self.rate(peer_id) is None:
            return None
        flow = self._flows.get(peer_id)
        if flow is None:
            flow = self._flows[peer_id] = Flow(self, peer_id)
        return flow


async def send_paced(parts, writer: asyncio.StreamWriter, flow: Flow | None, egress: TokenBucket | None = None) -> None:
    """Writes one protobuf message, serialized in `parts` (framing.frame_parts), to a hivemind stream
    as `P2P.send_protobuf` does, in pieces paced by `flow` and by `egress` (in-process shaping of all
    this peer sends: its rate, and its one-way delay, which every byte takes on a delay line without
    holding the sender: swarm.netlab.delayline). The header leaves before the pieces: as on a real
    link, the receiver sees a payload begin at once and end after its transfer time (the link meters
    time it from its first byte)."""
    line = DelayLine.of(writer, egress.delay_s) if egress is not None and egress.delay_s > 0 else None
    write = line.put if line is not None else writer.write
    write(P2P.MESSAGE_MARKER + sum(len(part) for part in parts).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    if flow is None and egress is None:
        for part in parts:
            writer.write(part)
        await writer.drain()
        return
    owed = 0  # bytes of small parts written at once, charged to the next piece (one wake-up, not two)
    for i, part in enumerate(parts):
        if len(part) < MIN_PIECE_BYTES and i + 1 < len(parts):
            write(part)
            owed += len(part)
            continue
        part, offset = memoryview(part), 0
        while offset < len(part):
            piece = part[offset : offset + (flow.next_piece() if flow is not None else piece_bytes(egress.rate_bits))]
            if flow is not None:
                await flow.piece(len(piece) + owed)
            if egress is not None:
                await egress.consume(len(piece) + owed)
            owed = 0
            write(piece)
            if line is None:
                await writer.drain()
            offset += len(piece)
    if line is None:  # else the line drains as it writes: the bytes have left, their delay runs on
        await writer.drain()
