"""The stage peer's server: one stream handler on hivemind's P2P for every call.

A caller opens a stream of the protocol `streams.PROTOCOL` and sends one request after another on
it (`streams.Requests`); each is framed and checked (`protocols.framing`: typed head, payload in
verified chunks, a size cap before anything is collected), dispatched on its head by one table
(`HANDLERS`: call kind -> handler) to the hosted stage it names, and answered with a reply of the
same kind. The server only frames and dispatches: a micro-batch's trip, from its arrival metered to
its reply written in paced pieces, is its stage's chain's (stage.chain); the other replies are
shaped by the node's in-process egress only.
Every failure becomes a one-line `ErrorReply`: a bad payload, a version mismatch, a stage this peer
does not host or an unknown request never stops it serving. After an error the stream is closed
(what is left of a refused request on it is unknown); the caller opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P

from protocols import stage_pb2 as pb
from protocols.calls import CALLS, Trust
from protocols.errors import ProtocolError, RemoteError, one_line
from protocols.framing import Frame, frame_parts, read_frame
from protocols.version import PROTOCOL_VERSION
from swarm.compression.feedback import StateMismatchError
from swarm.compression.state import StaleStateError
from swarm.transport.hivemind.dht.announce import Announcer
from swarm.transport.hivemind.flow.pacing import send_paced
from swarm.transport.hivemind.net.cpu import RequestCpu
from swarm.transport.hivemind.net.events import EventLog
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.streams import MAX_MESSAGE_BYTES, PROTOCOL, Request, Requests, linger
from swarm.transport.hivemind.stage.averaging import AVERAGING_NAMESPACE, ReplicaAverager
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.refusals import Refusals
from swarm.transport.hivemind.stage.rounds import ROUNDS
from swarm.transport.hivemind.stage.state import PeerServices

log = logging.getLogger(__name__)
MAX_HEAD_BYTES = 64 << 10  # a request's head and signature (a chunk's data aside): far more than any needs
# ... and what a message may hold besides its chunk's data, checked before protobuf parses any of
# it: the head and signature, their tags and lengths, and the chunk's own fields
MAX_MESSAGE_HEAD_BYTES = MAX_HEAD_BYTES + 64


def _check_version(address: pb.Address) -> None:
    if address.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {address.protocol_version} is not supported (this peer speaks version {PROTOCOL_VERSION})"
        )


def _code(e: BaseException) -> int:
    if isinstance(e, RemoteError):
        return e.code
    if isinstance(e, StateMismatchError | StaleStateError):  # our link state and the sender's differ
        return pb.LINK_RESET
    return pb.ERROR_UNSPECIFIED


@dataclass
class _Outcome:
    """How a request ended: its kind (as far as it was read) and, when it failed, why (the stream
    then closes: what is left of it is unknown)."""

    kind: str = "request"
    error: BaseException | None = None


class StageServer:
    def __init__(self, node: SwarmNode) -> None:
        self.node = node
        self.settings = node.settings
        self.hosted: dict[tuple[str, int], HostedStage] = {}
        self.announcer = Announcer(node, self._records)
        # sums of gradients with the peers sharing them, for every stage hosted (group ids name the run)
        self.averager = ReplicaAverager(node.p2p, AVERAGING_NAMESPACE, self.settings.calls.call_timeout_s)
        self._addrs: list[str] = []
        self._tasks: set[asyncio.Task] = set()
        self.events = EventLog()  # what happened to this peer and its stages (status, metrics)
        # requests refused, by why; senders of malformed bytes (a message that does not parse, a
        # payload that passes its checksum but not decoding), or whose refusals cost too much CPU,
        # refused at the head for a while, longer each time
        self.refusals = Refusals(self.settings, self.events)
        self.active: Counter = Counter()  # requests in progress per sender (settings.limits.max_requests_per_sender)
        self.held: Counter = Counter()  # their payload bytes (settings.limits.max_held_bytes_per_sender)

    async def start(self, announce: bool = True) -> None:
        self._addrs = await self.node.maddrs()
        await self.node.p2p.add_binary_stream_handler(PROTOCOL, self._serve)
        await self.averager.start()
        if announce:
            await self.announcer.announce_now()
            self.announcer.start()

    async def stop(self) -> None:
        await self.announcer.stop()
        await self.averager.stop()
        with contextlib.suppress(Exception):
            await self.node.p2p.remove_binary_stream_handler(PROTOCOL)
        for hosted in self.hosted.values():
            hosted.close()

    async def leave(self, say) -> None:
        """Drains every hosted stage (swarm.transport.hivemind.stage.leaving); then `stop()`."""
        await asyncio.gather(*(hosted.drain(say) for hosted in self.hosted.values()))

    def host(self, hosted: HostedStage) -> HostedStage:
        self.hosted[(hosted.run_id, hosted.stage)] = hosted
        hosted.attach(PeerServices(self.events, self.averager, self._announce_soon))
        return hosted

    def _announce_soon(self) -> None:
        """A hosted stage's record changed (joined, left the session, leaving): others see it now."""
        if self._addrs:  # started
            task = asyncio.get_running_loop().create_task(self.announcer.announce_now())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _records(self):
        return [(run_id, hosted.record(self._addrs)) for (run_id, _), hosted in self.hosted.items()]

    def _find(self, address: pb.Address) -> HostedStage:
        _check_version(address)
        hosted = self.hosted.get((address.run_id, address.stage))
        if hosted is None:
            have = ", ".join(f"{r}/stage{s}" for r, s in self.hosted) or "nothing"
            raise RemoteError(
                f"this peer does not host stage {address.stage} of run {address.run_id!r} (it hosts {have})"
            )
        return hosted

    def _turned_away(self, sender: str) -> pb.ErrorReply | None:
        """A banned sender's request, or one over its requests in progress, is not read at all."""
        if (refusal := self.refusals.turned_away(sender)) is not None:
            return refusal
        if self.active[sender] >= self.settings.limits.max_requests_per_sender:  # a while later it may
            message = f"peer {sender[-8:]} has {self.active[sender]} requests in progress here already"
            return pb.ErrorReply(message=message, code=pb.UNAVAILABLE)
        return None

    def _admit(self, kind: str, message, sender: str) -> None:
        """Refuses a request its sender may not make, before its payload is read
        (swarm.transport.hivemind.trust.gate)."""
        head = getattr(message, kind)
        if head.ByteSize() + message.auth.ByteSize() > MAX_HEAD_BYTES:
            raise ProtocolError(f"a head of more than {MAX_HEAD_BYTES} bytes")
        call = CALLS.get(kind)
        if call is None:
            raise ProtocolError(f"unknown request {kind!r}")
        if call.trust is Trust.OPEN:
            _check_version(head.to)
            return
        hosted = self._find(head.to)
        if call.trust is Trust.OWNER:
            hosted.gate.control(kind, head, message.auth, message.chunk)
        elif call.trust is Trust.NEIGHBOUR:
            hosted.gate.micro_batch(head, sender, hosted.session_id)
        else:
            hosted.gate.state(head, sender, hosted.session_id)

    def _limit(self, kind: str) -> int:
        """The largest payload a request of `kind` may carry."""
        return (
            self.settings.limits.max_micro_batch_bytes
            if kind == "micro_batch"
            else self.settings.limits.max_payload_bytes
        )

    # ---- the stream ------------------------------------------------------------------------

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()  # through a relay too: the caller it names (net.reach)
        requests = Requests(reader, MAX_MESSAGE_HEAD_BYTES)
        with contextlib.closing(writer):
            try:
                while await requests.next(self.settings.streams.server_idle_s):
                    if (refusal := self._turned_away(sender)) is not None:  # before reading anything of it
                        await P2P.send_protobuf(pb.StageReply(error=refusal), writer)
                        await linger(reader)
                        return
                    self.active[sender] += 1
                    cpu = RequestCpu()  # what serving it costs this peer, refusing it included
                    outcome = _Outcome()
                    try:
                        await cpu.run(self._one(requests, sender, writer, outcome))
                    finally:
                        self.active[sender] -= 1
                        if not self.active[sender]:
                            del self.active[sender]
                        self.refusals.charge(sender, outcome.kind, cpu.seconds, outcome.error)
                    if outcome.error is not None:
                        return
            except Exception as e:  # the stream broke (the caller sees that on its side)
                log.debug("stream from %s ended: %s", sender[-8:], one_line(e))

    async def _one(self, requests: Requests, sender: str, writer: asyncio.StreamWriter, outcome: _Outcome) -> None:
        """One request and its reply; `outcome` says how it ended (after an error the stream may
        carry no other)."""
        held = 0

        def check(head_kind: str, message) -> None:
            nonlocal held
            outcome.kind = head_kind
            self._admit(head_kind, message, sender)
            if head_kind == "micro_batch":  # its payload stays here until the reply is written
                held = self._hold(sender, message.chunk.total_length)

        try:
            try:
                frame = await read_frame(
                    requests.messages(), None, self._limit, self.settings.streams.read_timeout_s, check
                )
                reply = await self._dispatch(frame, requests, sender)
            except Exception as e:
                outcome.error = e
                self.refusals.refused(sender, outcome.kind, e)
                log.warning("%s from %s rejected: %s", outcome.kind, sender[-8:], one_line(e))
                error = pb.ErrorReply(
                    message=one_line(e),
                    code=_code(e),
                    blamed=getattr(e, "blamed", []),
                    stale=getattr(e, "stale", []),
                )
                await P2P.send_protobuf(pb.StageReply(error=error), writer)
                await requests.drain(self.settings.streams.drain_s, self._limit(outcome.kind) + MAX_MESSAGE_BYTES)
                return
            await asyncio.wait_for(reply(writer), self.settings.calls.call_timeout_s)  # a caller that stops reading
        finally:
            self._release(sender, held)

    def _hold(self, sender: str, size: int) -> int:
        """Counts `size` payload bytes against what `sender` may have here at once (refused when over)."""
        if self.held[sender] + size > self.settings.limits.max_held_bytes_per_sender:
            raise RemoteError(
                f"peer {sender[-8:]} would have {self.held[sender] + size} payload bytes here at once (limit {self.settings.limits.max_held_bytes_per_sender})",
                pb.UNAVAILABLE,
            )
        self.held[sender] += size
        return size

    def _release(self, sender: str, size: int) -> None:
        self.held[sender] -= size
        if self.held[sender] <= 0:
            del self.held[sender]

    async def _dispatch(self, frame: Frame, requests: Requests, sender: str):
        """The handler's answer to `frame` (`HANDLERS`: one per kind of protocols.calls), as a
        coroutine function that writes it."""
        return await HANDLERS[frame.kind](self, Request(frame, sender, requests.started, time.monotonic()))

    def _addressed(self, request: Request) -> HostedStage:
        """The hosted stage a call names; an owner's call's payload checked against its signature."""
        frame = request.frame
        hosted = self._find(frame.head.to)
        if CALLS[frame.kind].signed:
            hosted.gate.calls.payload(frame.kind, frame.first.auth, frame.payload)
        return hosted

    # ---- the handlers: one per kind of call (protocols.calls), in `HANDLERS` -------------------

    async def _serve_info(self, request: Request):
        _check_version(request.frame.head.to)
        return self._writer("info", self._info(request.frame.head), b"")

    async def _serve_setup(self, request: Request):
        reply = await self._addressed(request).setup(request.frame.head)
        await self.announcer.announce_now()  # others see it ready now, not at the next refresh
        return self._writer("setup", reply, b"")

    async def _serve_round(self, request: Request):
        """A step round or a checkpoint (stage.rounds)."""
        hosted, frame = self._addressed(request), request.frame
        return self._writer(frame.kind, *await hosted.rounds.handle(frame.kind, frame.head, frame.payload))

    async def _serve_snapshot(self, request: Request):
        hosted, frame = self._addressed(request), request.frame
        return self._writer("snapshot", *await hosted.snapshots.snapshot(frame.head, frame.payload))

    async def _serve_restore(self, request: Request):
        hosted, frame = self._addressed(request), request.frame
        return self._writer("restore", *await hosted.snapshots.restore(frame.head, frame.payload))

    async def _serve_state(self, request: Request):
        hosted, head = self._addressed(request), request.frame.head
        if head.snapshot:  # a copy the swarm keeps
            return self._writer("state", *hosted.snapshots.serve(head), flow=hosted.snapshots.paced(head))
        head, payload = await hosted.source.serve()
        return self._writer("state", head, payload, hosted.source.done)

    def _writer(self, kind: str, head, payload: bytes, done=None, flow=None):
        """`done(bytes sent)`: called once the reply is written, or failed to be; `flow`: its pacing
        besides the node's egress (a holder's copy: flow.background)."""

        async def write(writer: asyncio.StreamWriter) -> None:
            sent = 0
            try:
                for parts in frame_parts(pb.StageReply, kind, head, payload):
                    await send_paced(parts, writer, flow, self.node.egress)
                sent = len(payload)
            finally:
                if done is not None:
                    done(sent)

        return write

    async def _serve_micro_batch(self, request: Request):
        """Its trip through the stage, reply included, is the chain's (stage.chain)."""
        head = request.frame.head
        if head.sender and head.sender != request.sender:
            raise ProtocolError(
                f"sender {head.sender[-8:]} in the head is not the connected peer {request.sender[-8:]}"
            )
        return await self._find(head.to).chain.serve(request)

    def status(self) -> pb.InfoReply:
        """The status of this peer and every stage it hosts (what peers.status and its metrics read)."""
        return self._info(pb.InfoRequest())

    def _info(self, request: pb.InfoRequest) -> pb.InfoReply:
        reply = pb.InfoReply(protocol_version=PROTOCOL_VERSION, peer_id=self.node.peer_id, addrs=self._addrs)
        reply.refused.update(self.refusals.counted)
        banned = self.refusals.banned
        reply.banned = sum(1 for peer in banned.until if banned.banned(peer))
        reply.events.extend(event.to_pb() for event in self.events.last())
        reply.reach.CopyFrom(self.node.reach.status(self.node.relay))
        for (run_id, _), hosted in sorted(self.hosted.items()):
            if not request.to.run_id or request.to.run_id == run_id:
                reply.stages.append(hosted.status())
        return reply


Handler = Callable[[StageServer, Request], Awaitable[Callable]]


def checked(handlers: dict[str, Handler], rounds: frozenset[str]) -> dict[str, Handler]:
    """`handlers` when it has one handler for every kind of protocols.calls and none for another,
    and the step rounds' handler takes exactly the kinds `StageRounds` serves (`rounds`); else
    raises, at import: a kind that lost its handler fails before any peer serves it."""
    missing, unknown = sorted(CALLS.keys() - handlers.keys()), sorted(handlers.keys() - CALLS.keys())
    routed = {kind for kind, handler in handlers.items() if handler is StageServer._serve_round}
    if missing or unknown or routed != rounds:
        raise ImportError(
            f"the stage server's handlers do not match protocols.calls: no handler of {missing}, a handler of "
            f"no call {unknown}, rounds routed {sorted(routed)} but served {sorted(rounds)}"
        )
    return handlers


# call kind -> its handler: the server's only dispatch (a renamed or missing handler fails at import)
HANDLERS: dict[str, Handler] = checked(
    {
        "micro_batch": StageServer._serve_micro_batch,
        "setup": StageServer._serve_setup,
        "info": StageServer._serve_info,
        "gather": StageServer._serve_round,
        "set_grads": StageServer._serve_round,
        "apply": StageServer._serve_round,
        "save": StageServer._serve_round,
        "load": StageServer._serve_round,
        "state": StageServer._serve_state,
        "snapshot": StageServer._serve_snapshot,
        "restore": StageServer._serve_restore,
    },
    ROUNDS,
)
