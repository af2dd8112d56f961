"""The stage peer's RPC servicer on hivemind's P2P (ServicerBase, our own protobufs).

It frames and checks what arrives, hands micro-batches and steps to the `HostedStage`, and turns
every failure into a one-line `ErrorReply`: a bad payload, a version mismatch or a stage this
peer does not host never stops it serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator  # noqa: UP035 (hivemind's ServicerBase recognises typing's alias only)

from hivemind.p2p import P2P, P2PContext, ServicerBase

from protocols import stage_pb2 as pb
from protocols.framing import (
    MAX_MICRO_BATCH_BYTES,
    ProtocolError,
    Received,
    frame,
    frame_parts,
    parse_message,
    read_frame,
)
from swarm.compression.feedback import StateMismatchError
from swarm.compression.state import StaleStateError
from swarm.engine.microbatch import Kind
from swarm.transport.hivemind import PROTOCOL_VERSION
from swarm.transport.hivemind.announce import Announcer
from swarm.transport.hivemind.calls import NAMESPACE, RemoteError, handle_name
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.pacing import carrying, send_paced
from swarm.transport.hivemind.stage.host import HostedStage

log = logging.getLogger(__name__)
IDLE_S = 60.0  # a micro-batch stream with no request for this long is closed (callers stop reusing one sooner: calls.KEEP_IDLE_S)
_KINDS = {Kind.FORWARD: pb.FORWARD, Kind.BACKWARD: pb.BACKWARD, Kind.DONE: pb.DONE}


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    text = text.splitlines()[0] if text else ""
    if isinstance(e, RemoteError | ProtocolError) and text:
        return text[:500]
    return f"{type(e).__name__}: {text}"[:500] if text else type(e).__name__


def _check_version(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this peer speaks version {PROTOCOL_VERSION})"
        )


def _code(e: BaseException) -> int:
    if isinstance(e, RemoteError):
        return e.code
    if isinstance(e, StateMismatchError | StaleStateError):  # our link state and the sender's differ
        return pb.LINK_RESET
    return pb.ERROR_UNSPECIFIED


async def _pace(egress, message, first: bool) -> None:
    """In-process shaping of a step reply, which ServicerBase writes whole (micro-batch replies go
    out in shaped pieces: pacing.send_paced)."""
    if egress is not None:
        await egress.send_delay(message.ByteSize(), first=first)


def _error(e: BaseException) -> pb.StageReply:
    return pb.StageReply(error=pb.ErrorReply(message=one_line(e), code=_code(e)))


async def _linger(requests, timeout: float = 10.0) -> None:
    """Keeps the stream open until the caller ends it.

    Closing right after the last reply was seen to cut replies short on their way through p2pd
    (the caller then reads fewer chunks, or none); the caller ends the stream once it has read
    the whole reply, so waiting for that costs nothing.
    """
    try:

        async def drain():
            async for _ in requests:
                pass

        await asyncio.wait_for(drain(), timeout)
    except Exception:
        pass


class Requests:
    """The requests a caller sends on one reused stream (calls.StreamPool), one after another.

    `next` waits for the first byte of the next request and notes when it came: a sender starts
    writing a payload as soon as its send slot is free, so that byte marks the start of the
    payload's transfer (what the link meters time), whether the stream is new or reused."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.started = 0.0
        self._begun = False  # `next` read the first message's marker already

    async def next(self, idle_timeout: float) -> bool:
        """True when a request begins; False when the caller ended the stream or let it idle."""
        try:
            marker = await asyncio.wait_for(self.reader.readexactly(1), idle_timeout)
        except (asyncio.IncompleteReadError, TimeoutError):
            return False
        self.started = time.monotonic()
        self._begun = marker == P2P.MESSAGE_MARKER  # else the end-of-stream marker
        return self._begun

    async def messages(self) -> AsyncIterator[Received]:
        """This request's messages (a reader of one frame stops at its last one) and, read on,
        whatever follows until the caller ends the stream."""
        while True:
            begun, self._begun = self._begun, False
            try:
                if not begun and await self.reader.readexactly(1) != P2P.MESSAGE_MARKER:
                    return
                data = await P2P.receive_raw_data(self.reader)
            except asyncio.IncompleteReadError:
                return
            yield parse_message(pb.StageRequest, data)


class StageServicer(ServicerBase):
    def __init__(
        self,
        node: SwarmNode,
        read_timeout: float = 60.0,
        idle_timeout: float = IDLE_S,
        max_payload: int = MAX_MICRO_BATCH_BYTES,
    ) -> None:
        self.node = node
        self.max_payload = max_payload  # bytes of one micro-batch's payload
        self.hosted: dict[tuple[str, int], HostedStage] = {}
        self.read_timeout = read_timeout  # seconds between the messages of one payload
        self.idle_timeout = idle_timeout  # seconds a micro-batch stream may wait for its next request
        self.announcer = Announcer(node, self._records)
        self._addrs: list[str] = []

    async def start(self, announce: bool = True) -> None:
        self._addrs = await self.node.maddrs()
        await self.add_p2p_handlers(self.node.p2p, namespace=NAMESPACE)
        await self.node.p2p.add_binary_stream_handler(handle_name("rpc_forward"), self._forward_stream)
        if announce:
            await self.announcer.announce_now()
            self.announcer.start()

    async def stop(self) -> None:
        await self.announcer.stop()
        for hosted in self.hosted.values():
            hosted.close()

    def host(self, hosted: HostedStage) -> HostedStage:
        self.hosted[(hosted.run_id, hosted.stage)] = hosted
        return hosted

    async def unhost(self, run_id: str, stage: int) -> None:
        hosted = self.hosted.pop((run_id, stage), None)
        if hosted is not None:
            hosted.close()

    def _records(self):
        return [(run_id, hosted.record(self._addrs)) for (run_id, _), hosted in self.hosted.items()]

    def _find(self, run_id: str, stage: int) -> HostedStage:
        hosted = self.hosted.get((run_id, stage))
        if hosted is None:
            have = ", ".join(f"{r}/stage{s}" for r, s in self.hosted) or "nothing"
            raise RemoteError(f"this peer does not host stage {stage} of run {run_id!r} (it hosts {have})")
        return hosted

    # ---- streamed calls --------------------------------------------------------------------

    async def _forward_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """`rpc_forward`, served on the raw stream rather than by ServicerBase, so that replies can
        be written in paced pieces (swarm.transport.hivemind.pacing) and the stream can carry one micro-batch
        after another (calls.StreamPool); the bytes of each exchange are the same."""
        sender = info.peer_id.to_base58()
        requests = Requests(reader)
        with contextlib.closing(writer):
            try:
                while await requests.next(self.idle_timeout):
                    if not await self.forward(requests, sender, writer):
                        return
            except Exception as e:  # the stream broke (the caller sees that on its side)
                log.debug("micro-batch stream from %s ended: %s", sender[-8:], one_line(e))

    async def forward(self, requests: Requests, sender: str, writer: asyncio.StreamWriter) -> bool:
        """One micro-batch: activations in, gradients (or DONE) out; whether the stream may carry
        another (not after an error: what is left of a refused request on it is unknown)."""
        try:
            head, payload = await read_frame(requests.messages(), "micro_batch", self.max_payload, self.read_timeout)
            arrived = time.monotonic()
            _check_version(head.protocol_version)
            if head.sender and head.sender != sender:
                raise ProtocolError(f"sender {head.sender[-8:]} in the head is not the connected peer {sender[-8:]}")
            hosted = self._find(head.run_id, head.stage)
            hosted.arrivals[sender].add(requests.started, arrived, len(payload))
            outcome = await hosted.micro_batch(head, payload, sender)
        except Exception as e:
            log.warning("micro-batch from %s rejected: %s", sender[-8:], one_line(e))
            await P2P.send_protobuf(_error(e), writer)
            await _linger(requests.messages())
            return False
        pacer = hosted.pacer
        pacer.heard(sender, head.reply_share_bits)
        pacer.arrived(sender, len(payload))
        async with hosted.sending.to(sender):
            result = pb.ResultHead(
                kind=_KINDS[outcome.kind],
                metrics=outcome.metrics,
                route=outcome.route,
                share_bits=pacer.offer(sender, hosted.awaiting > 0),
            )
            flow = pacer.flow(sender)
            with carrying(flow, len(outcome.payload)):
                for i, parts in enumerate(frame_parts(pb.StageReply, "result", result, outcome.payload)):
                    await send_paced(parts, writer, flow, self.node.egress, first=i == 0)
        return True

    async def rpc_step(
        self, requests: AsyncIterator[pb.StageRequest], context: P2PContext
    ) -> AsyncIterator[pb.StageReply]:
        """One round of the synchronous step: tied gradients, norm, scale, apply."""
        try:
            head, payload = await read_frame(requests, "step", idle_timeout=self.read_timeout)
            _check_version(head.protocol_version)
            result, data = await self._find(head.run_id, head.stage).step(head, payload)
        except Exception as e:
            log.warning("step from %s rejected: %s", context.remote_id.to_base58()[-8:], one_line(e))
            yield _error(e)
            await _linger(requests)
            return
        for i, message in enumerate(frame(pb.StageReply, "step", result, data)):
            await _pace(self.node.egress, message, first=i == 0)
            yield message
        await _linger(requests)

    # ---- unary calls -----------------------------------------------------------------------

    async def rpc_setup(self, request: pb.SetupRequest, context: P2PContext) -> pb.SetupReply:
        try:
            _check_version(request.protocol_version)
            reply = await self._find(request.run_id, request.stage).setup(request)
        except Exception as e:
            return pb.SetupReply(error=one_line(e), peer_id=self.node.peer_id)
        await self.announcer.announce_now()  # others see it ready now, not at the next refresh
        return reply

    async def rpc_info(self, request: pb.InfoRequest, context: P2PContext) -> pb.InfoReply:
        reply = pb.InfoReply(protocol_version=PROTOCOL_VERSION, peer_id=self.node.peer_id, addrs=self._addrs)
        try:
            _check_version(request.protocol_version)
        except ProtocolError as e:
            reply.error = one_line(e)
            return reply
        for (run_id, _), hosted in sorted(self.hosted.items()):
            if not request.run_id or request.run_id == run_id:
                reply.stages.append(hosted.status())
        return reply
