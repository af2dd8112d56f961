"""Handing a micro-batch on to a peer of the next stage: the trainer to stage 0, a stage peer to
the stage after it. The same code does both: choosing the peer (the router's choice, sticking to
the peer in use so link state stays on one pair), numbering the link's messages, the exchange,
and, when it fails, the retry policy's answer (`retry.Retry`): the same peer on a new link epoch,
or another peer of that stage, the failed one banned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from protocols import carried as envelope
from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError
from protocols.framing import Frame
from swarm.engine.microbatch import MicroBatch
from swarm.tracing import TRACER
from swarm.transport.hivemind.dht.announce import StageRecord
from swarm.transport.hivemind.flow.meter import LinkMeter
from swarm.transport.hivemind.flow.pacing import FlowPacer
from swarm.transport.hivemind.net.calls import Carriage, Exchange, Sending
from swarm.transport.hivemind.net.meta import address, batch_to_meta, carried_of
from swarm.transport.hivemind.net.retry import Retry
from swarm.transport.hivemind.routing.router import NoPeerError, Router
from swarm.transport.hivemind.trust.check_tokens import avoided

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkHooks:
    """What the handoff's caller keeps of its links to the next stage.

    `lost(peer)` is called when the link to a peer lost its order or state (the caller restarts
    its numbering, and drops its link end if it has one); `replies` meters how fast each peer's
    replies arrive (None: not metered); `stateful()`: whether the link's codecs keep state across
    micro-batches (error feedback): then micro-batches keep to one peer while it is not much
    slower, for load they would split across replicas and change the numbers; `admission()`: this
    peer's admission to the session, shown with every micro-batch."""

    lost: Callable[[str], None]
    replies: dict[str, LinkMeter] | None = None
    stateful: Callable[[], bool] = lambda: False
    admission: Callable[[], pb.Admission | None] = lambda: None


@dataclass(slots=True)  # one per micro-batch: slots, not frozen, construct fastest
class Terms:
    """How one micro-batch is handed on: to the peers of trainer session `session`; with a
    `deadline` (monotonic) every try gets what is left of it, without, each gets the call timeout
    (plus a grace, so a stage's own timeout error arrives first); `offer(peer)`: what this peer can
    take back from it (pacing); `carry`: a head whose words of the run are handed on: the owner's
    step proof and roster, and a step closed on the way (`closing`, `decision`:
    swarm.transport.hivemind.stage.closing); `avoid`: peers it must not go to, first try or retry
    (the owner's check: `avoided`, or the trainer's own choice of stage 0)."""

    session: str
    deadline: float | None = None
    offer: Callable[[str], float] | None = None
    carry: pb.MicroBatchHead | None = None
    avoid: frozenset[str] = frozenset()


class Handoff:
    """Micro-batches from this peer to the peers of `stage`, of the run `router` routes (on its
    node). `pacer` and `sending` are the peer's own (they also pace and order what it sends
    elsewhere)."""

    def __init__(self, router: Router, stage: int, pacer: FlowPacer, sending: Sending, hooks: LinkHooks) -> None:
        self.node, self.router, self.run_id, self.stage = router.node, router, router.run_id, stage
        self.pacer, self.sending, self.lost, self.replies = pacer, sending, hooks.lost, hooks.replies
        self.stateful = hooks.stateful
        self.admission = hooks.admission  # ours in the current session: the receiver checks it before the payload
        self.settings = router.node.settings
        self.retry = Retry(self.settings)
        self.sticky: str | None = None  # the peer the micro-batches follow (its link state)
        self.retries = 0  # micro-batches sent again after a failure (metrics)
        self.awaiting = 0  # micro-batches whose replies we wait for (pacing offers) ...
        self.waiting: Counter = Counter()  # ... per peer (routing)
        self.check_key = b""  # the owner's key for its checks' avoid tokens (trust.check_tokens)

    async def avoided(self, head: pb.MicroBatchHead) -> frozenset[str]:
        """The next stage's peers the owner's check tokens in `head` tell us to avoid."""
        if not head.avoid_tokens or not self.check_key:
            return frozenset()
        peers = [record.peer_id for record in await self.router.peers(self.stage)]
        return frozenset(avoided(self.check_key, head.batch.attempt, head.avoid_tokens, peers))

    async def choose(self, session: str, exclude=()) -> StageRecord:
        stateful = self.stateful()  # only a link state is worth keeping to one peer for
        record = await self.router.choose(
            self.stage,
            exclude=exclude,
            sticky=self.sticky if stateful else None,
            session=session,
            waiting=self.router.policy.awaited(stateful, self.waiting),
        )
        self.sticky = record.peer_id
        return record

    def restart(self) -> None:
        """Every link restarted: the next micro-batch chooses its peer afresh."""
        self.sticky = None

    def forget(self, peer_id: str) -> None:
        """Micro-batches no longer follow `peer_id` (its link was reset): the router chooses afresh."""
        if self.sticky == peer_id:
            self.sticky = None

    def _lose(self, peer_id: str) -> None:
        self.forget(peer_id)
        self.lost(peer_id)

    async def send(
        self,
        batch: MicroBatch,
        record: StageRecord,
        sent: tuple[int, int],
        body: bytes,
        again: Callable[[str], Awaitable[tuple[tuple[int, int], bytes]]],
        terms: Terms,
        inputs=None,
    ) -> tuple[Frame, str, tuple[int, int]]:
        """The reply to `batch` with its activations `body` (numbered `sent` on the link to
        `record`'s peer), on `terms`; the peer that gave it and the number the payload had on that
        link. Before each retry `again(peer)` numbers and encodes the activations for that peer's
        link. The payload carries the micro-batch's sample ids and targets ahead of `body`, and
        stage 0's `inputs` when given (the trainer's)."""
        session, deadline, offer, carry = terms.session, terms.deadline, terms.offer, terms.carry
        meta = batch_to_meta(batch)
        carried = carried_of(batch, inputs)
        tried: set[str] = set(terms.avoid)  # (the owner's verification)
        further: set[str] = set()  # peers that answered DOWNSTREAM once (a second time: another peer)
        target = record.peer_id
        attempt = 0
        while True:
            tried.add(target)
            if deadline is None:
                budget = self.settings.calls.call_timeout_s
                timeout = budget + self.settings.calls.reply_grace_s
            else:
                budget = timeout = max(deadline - time.monotonic(), self.settings.calls.min_budget_s)
            head = pb.MicroBatchHead(
                to=address(self.run_id, self.stage),
                sender=self.node.peer_id,
                batch=meta,
                budget_s=budget,
                epoch=sent[0],
                seq=sent[1],
                reply_share_bits=offer(target) if offer is not None else 0.0,
            )
            if (admission := self.admission()) is not None:
                head.admission.CopyFrom(admission)
            if carry is not None:
                _hand_on(carry, head)
            self.pacer.heard(target, record.download_share, fallback=True)
            meter = self.replies[target] if self.replies is not None else None
            how = Carriage(
                self.sending,
                self.pacer.flow(target),
                meter,
                max_reply_bytes=self.settings.limits.max_micro_batch_bytes,
                traced=(batch.label, f"{batch.label}/{sent[0]}/{sent[1]}") if TRACER.enabled else None,
            )
            payload = envelope.pack(carried, body)
            exchange = Exchange(self.node.streams, target, "micro_batch", head, payload, how)
            try:
                frame = await self._reply(exchange, timeout)
                break
            except (TransportError, RemoteError) as e:
                self._lose(target)
                elsewhere = isinstance(e, TransportError) or e.other_peer
                # DOWNSTREAM twice from one peer: another of its stage, if there is one
                again_downstream = not elsewhere and e.downstream and target in further
                if not elsewhere and e.downstream:
                    further.add(target)
                if elsewhere:  # banned even when no retry is left: the caller's next try goes elsewhere
                    self.router.failed(target)
                if not self.retry.again(e, attempt, deadline):
                    raise
                if elsewhere:
                    try:
                        record = await self.choose(session, exclude=tried)
                    except NoPeerError:
                        if not isinstance(e, TransportError) or len(tried) > 1:
                            raise e from None
                        # the stage's only peer failed to answer: once more after a pause (a dial can
                        # fail once); a dead one fails again and the error goes up
                        await asyncio.sleep(self.retry.backoff_s * (attempt + 1))
                elif again_downstream:
                    with contextlib.suppress(NoPeerError):
                        record = await self.choose(session, exclude=tried | {target})
                        self.router.failed(target)
                log.warning(
                    "micro-batch %s: stage %d peer %s failed (%s); retrying on %s",
                    batch.key,
                    self.stage,
                    target[-8:],
                    e,
                    record.peer_id[-8:],
                )
                target = record.peer_id
                sent, body = await again(target)
                attempt += 1
                self.retries += 1
        self.pacer.heard(target, frame.head.share_bits)
        self.pacer.arrived(target, len(frame.payload))
        exchange.finish()
        self.router.succeeded(target)
        return frame, target, sent

    async def _reply(self, exchange: Exchange, timeout: float) -> Frame:
        self.awaiting += 1
        self.waiting[exchange.peer_id] += 1
        try:
            return await exchange.reply(timeout)
        finally:
            self.awaiting -= 1
            self.waiting[exchange.peer_id] -= 1


def _hand_on(carry: pb.MicroBatchHead, head: pb.MicroBatchHead) -> None:
    """The words of the run in `carry` (the owner's, the step's count, the peers a verification
    avoids) into `head`."""
    for name in ("step_proof", "decision", "roster"):
        if carry.HasField(name):
            getattr(head, name).CopyFrom(getattr(carry, name))
    head.closing = carry.closing
    head.avoid_tokens.extend(carry.avoid_tokens)
