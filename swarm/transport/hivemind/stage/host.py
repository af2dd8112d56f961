"""One stage hosted by a peer: the engine's `StageRuntime` plus what the network adds.

The runtime is the same one the in-process transport drives; this wrapper gives it one link end
per neighbour peer (so error-feedback state and reused TopK indices are keyed by the pair, and a
new neighbour starts fresh), calls the next stage's peer, and measures throughput. A micro-batch
runs as a chain: forward here, the downstream call (whose reply is the gradient), backward here,
and the result goes back to the caller, so forward and backward of a micro-batch always use the
same pair of peers on every boundary.

Several micro-batches are in flight at once: while one waits for its downstream reply, the next
one's forward runs. Link state commits as soon as a message is encoded or decoded; the order of
messages on every link is kept by `swarm.transport.hivemind.ordering`, and any failure on a link makes the
sender start a new epoch, so both ends restart that link's state together instead of diverging.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from protocols import stage_pb2 as pb
from protocols.framing import ProtocolError
from swarm.config import ExperimentConfig
from swarm.engine.linkend import LinkEnd
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.transport.hivemind import PROTOCOL_VERSION
from swarm.transport.hivemind.announce import StageRecord
from swarm.transport.hivemind.calls import MicroBatchCall, RemoteError, Sending, TransportError
from swarm.transport.hivemind.meta import (
    batch_to_meta,
    meta_to_batch,
    payload_to_tensors,
    raw_to_tensor,
    tensors_to_payload,
)
from swarm.transport.hivemind.meter import LinkMeter, MeteredCall
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.ordering import LinkReset, Ordinals, OutLink, Turnstile
from swarm.transport.hivemind.pacing import FlowPacer, stage_flows
from swarm.transport.hivemind.routing import NoPeerError, Router
from swarm.transport.hivemind.stage.clock import ComputeClock
from swarm.transport.hivemind.stage.codecs import install, switched_config

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
_BUILD_LOCK = threading.Lock()  # models are built under the global torch seed: one build at a time per process


def config_digest(cfg: ExperimentConfig) -> str:
    """What a stage's computation depends on; trainer and stage must agree on it."""
    data = cfg.model_dump(
        mode="json", include={"seed", "model", "optimizer", "compression"}, exclude={"compression": {"store_dir"}}
    )  # where a peer keeps its rows is its own business
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Outcome:
    """A processed micro-batch: the reply for the caller."""

    kind: Kind
    payload: bytes = b""
    metrics: dict[str, float] = field(default_factory=dict)
    route: list[str] = field(default_factory=list)


class HostedStage:
    def __init__(
        self,
        node: SwarmNode,
        run_id: str,
        cfg: ExperimentConfig,
        stage: int,
        device: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        if not 0 <= stage < cfg.model.num_stages:
            raise ValueError(
                f"stage {stage} does not exist: the config has {cfg.model.num_stages} stages (0..{cfg.model.num_stages - 1})"
            )
        self.node, self.run_id, self.stage = node, run_id, stage
        self.cfg = cfg if device is None else cfg.model_copy(update={"device": device})
        self._configured = self.cfg  # what a new trainer session starts from (adaptive codecs change self.cfg)
        self.num_stages = cfg.model.num_stages
        self.digest = config_digest(cfg)
        self.timeout = timeout
        self.router = Router(node, run_id)
        self.runtime = None
        self.session: tuple | None = None
        self.tied: list = []
        self.capacity: int | None = None
        self.ends_in: dict[str, LinkEnd] = {}  # upstream peer -> our half of that link
        self.ends_out: dict[str, LinkEnd] = {}  # downstream peer -> our half of that link
        self.out_links: dict[str, OutLink] = {}
        self.turnstiles: dict[str, Turnstile] = {}
        self.ordinals = Ordinals()
        self.link_grace = 10.0  # seconds a message of an unknown link epoch waits for the epoch's first
        self.peak_queue = 0  # most micro-batches inside this stage at once
        self._spare: dict[bool, LinkEnd | None] = {}
        self._ends_made = 0
        self.received: Counter = Counter()  # (neighbour, direction, mode) -> bytes
        self.arrivals: defaultdict[str, LinkMeter] = defaultdict(
            LinkMeter
        )  # upstream peer -> how fast its activations arrive
        self.replies: defaultdict[str, LinkMeter] = defaultdict(
            LinkMeter
        )  # downstream peer -> how fast its gradients arrive
        self.retired: dict[
            tuple[str, bool], tuple[int, Counter, Counter]
        ] = {}  # (neighbour, upstream) -> boundary, bytes, raw of replaced ends
        self.downstream: str | None = None
        self.upstream: str | None = None  # the neighbour whose link a checkpoint keeps
        self.throughput = 0.0
        self.queue = 0
        self.processed = 0
        self.steps = 0
        self.compute = ComputeClock()  # training compute (the compute bounds of throughput benchmarks)
        self._applied: tuple[int, pb.StepResult] | None = None
        self.sending = Sending()  # activations down, gradients up: a few payloads per neighbour at a time
        self.pacer = FlowPacer(node.uplink_bits, node.downlink_bits, stage_flows(stage, self.num_stages))
        self.awaiting = 0  # micro-batches whose gradients we wait for from downstream (pacing offers)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    # ---- setup ---------------------------------------------------------------------------

    def _build(self, lr_horizon: int, capacity: int | None) -> None:
        from swarm.engine.build import build_runtime, build_staged_model

        with _BUILD_LOCK:
            staged = build_staged_model(self.cfg)
            runtime = build_runtime(self.cfg, staged, self.stage, lr_horizon, capacity, hold_grads=True)
        self._spare = {False: runtime.inbound, True: runtime.outbound}
        for table in (
            self.ends_in,
            self.ends_out,
            self.out_links,
            self.turnstiles,
            self.received,
            self.arrivals,
            self.replies,
            self.retired,
        ):
            table.clear()
        self.ordinals = Ordinals()
        self.tied = list(staged.tied)
        self.capacity = capacity
        self.runtime = runtime

    async def setup(self, request: pb.SetupRequest) -> pb.SetupReply:
        """A trainer (re)starts the run: a new session builds the stage afresh."""
        if request.config_digest != self.digest:
            raise RemoteError(
                f"config mismatch on stage {self.stage}: this peer has {self.digest}, the trainer {request.config_digest} (start both with the same config and --set)"
            )
        session = (request.session, int(request.lr_horizon), int(request.capacity))
        if self.session != session or self.runtime is None:
            self.cfg = self._configured
            await self._compute(self._build, int(request.lr_horizon), int(request.capacity) or None)
            self.session = session
            self.steps = 0
            self._applied = None
        tied = [
            pb.TiedParam(
                first_stage=t.first[0], first_name=t.first[1], second_stage=t.second[0], second_name=t.second[1]
            )
            for t in self.tied
        ]
        return pb.SetupReply(peer_id=self.node.peer_id, tied=tied)

    def record(self, addrs: list[str]) -> StageRecord:
        link = self.cfg.compression.link(self.stage - 1) if self.stage > 0 else None
        codecs = {"forward": link.forward, "backward": link.backward} if link else {}
        session = self.session[0] if self.session else ""
        return StageRecord(
            self.node.peer_id,
            self.stage,
            self.num_stages,
            addrs,
            self.throughput,
            self.queue,
            codecs,
            PROTOCOL_VERSION,
            ready=self.runtime is not None,
            session=session,
            download_share=self.pacer.download_share,
        )

    # ---- link ends per neighbour ---------------------------------------------------------

    def _new_end(self, upstream: bool, neighbour: str) -> LinkEnd:
        """A fresh half-link (the runtime's own, possibly restored from a checkpoint, first); ends
        are replaced, never reset in place (a compute may still hold the old one)."""
        spare = self._spare.get(upstream)
        if spare is not None:
            self._spare[upstream] = None
            return spare
        return self._make_end(upstream, neighbour[-12:])

    def _make_end(self, upstream: bool, label: str) -> LinkEnd:
        boundary = self.stage if upstream else self.stage - 1
        link = self.cfg.compression.link(boundary)
        store = self.cfg.compression.store_dir
        self._ends_made += 1
        store = None if store is None else f"{store}/stage{self.stage}-{label}-{self._ends_made}"
        return LinkEnd(
            boundary, upstream, link.forward, link.backward, store, self.cfg.compression.store_capacity or self.capacity
        )

    def _end_in(self, sender: str, fresh: bool) -> LinkEnd:
        end = self.ends_in.get(sender)
        if end is None or fresh:
            self._retire(sender, False, self.ends_in.get(sender))
            end = self.ends_in[sender] = self._new_end(False, sender)
        return end

    def _retire(self, neighbour: str, upstream: bool, end: LinkEnd | None) -> None:
        """Keeps a replaced end's byte counts: the status reports a link's totals across its epochs."""
        if end is None:
            return
        _, sent, raw = self.retired.setdefault((neighbour, upstream), (end.boundary, Counter(), Counter()))
        sent.update(end.bytes)
        raw.update(end.raw)

    def _end_out(self, receiver: str) -> LinkEnd:
        end = self.ends_out.get(receiver)
        if end is None:
            end = self.ends_out[receiver] = self._new_end(True, receiver)
            self.out_links.setdefault(receiver, OutLink()).reset()
        return end

    def _drop_out(self, receiver: str) -> None:
        """Our link with `receiver` lost its order or state: the next message starts a new epoch."""
        self._retire(receiver, True, self.ends_out.pop(receiver, None))
        if self.downstream == receiver:
            self.downstream = None

    # ---- compute ---------------------------------------------------------------------------

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _forward(self, batch: MicroBatch, data, inbound: LinkEnd | None, outbound: LinkEnd | None) -> Message:
        started = self.compute.start()
        self.runtime.inbound, self.runtime.outbound = inbound, outbound
        message = self.runtime.forward(batch, data)
        message.delivered()  # link state commits on encoding; a failed delivery resets the link
        if batch.mode is Mode.TRAIN:
            self.compute.stop(started, batch.size)
        return message

    def _backward(
        self, batch: MicroBatch, payload: bytes, metrics: dict, inbound: LinkEnd | None, outbound: LinkEnd
    ) -> Message:
        started = self.compute.start()
        self.runtime.inbound, self.runtime.outbound = inbound, outbound
        message = self.runtime.backward(batch, payload, metrics)
        message.delivered()
        self.compute.stop(started)
        return message

    def _resend(self, batch: MicroBatch, outbound: LinkEnd, message: Message) -> Message:
        """The same activations for a new link: re-encoded against its fresh state."""
        if batch.mode is Mode.EVAL:
            return message  # stateless encoding: valid on any link
        saved = self.runtime._saved.get(batch.key)
        if saved is None:
            raise RuntimeError(f"stage {self.stage} lost the activations of micro-batch {batch.key}")
        out = outbound.send(batch, saved[1].detach())
        out.commit()
        return Message(Kind.FORWARD, self.stage + 1, batch, out.payload)

    def _measure(self, batch: MicroBatch, seconds: float) -> None:
        if seconds > 0:
            rate = batch.size / seconds
            self.throughput = rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * rate

    # ---- one micro-batch -------------------------------------------------------------------

    async def micro_batch(self, head: pb.MicroBatchHead, payload: bytes, sender: str) -> Outcome:
        """Forward here, then downstream and backward here; the reply for `sender`."""
        if self.runtime is None:
            raise RemoteError(
                f"stage {self.stage} of run {self.run_id!r} is not set up yet (the trainer sets stages up when it starts)",
                pb.NOT_READY,
            )
        if head.kind != pb.FORWARD:
            raise ProtocolError(f"rpc_forward expects a FORWARD head, got kind {head.kind}")
        batch = meta_to_batch(head.batch)
        deadline = (
            time.monotonic() + (head.budget_s or self.timeout) - 0.5
        )  # from arrival: the sender's clock runs meanwhile
        runtime = self.runtime
        self.queue += 1
        self.peak_queue = max(self.peak_queue, self.queue)
        try:
            outcome = await self._chain(head, batch, payload, sender, deadline)
        except BaseException:
            if runtime is self.runtime:
                await self._compute(runtime.drop, batch)
            raise
        finally:
            self.queue -= 1
        self.processed += 1
        return outcome

    async def _chain(
        self, head: pb.MicroBatchHead, batch: MicroBatch, payload: bytes, sender: str, deadline: float
    ) -> Outcome:
        started = time.perf_counter()
        ticket = None
        try:
            gate = self.turnstiles.setdefault(sender, Turnstile())
            async with gate.admit(
                head.epoch, head.seq, max(deadline - time.monotonic(), 0.1), self.link_grace
            ) as fresh:
                if self.first:
                    inputs = pb.RawTensor()
                    inputs.ParseFromString(payload)
                    data, inbound = raw_to_tensor(inputs, "stage 0 input"), None
                else:
                    data, inbound = payload, self._end_in(sender, fresh)
                    self.upstream = sender
                    self.received[(sender, "forward", batch.mode.value)] += len(payload)
                target = (
                    None
                    if self.last
                    else await self.router.choose(self.stage + 1, sticky=self.downstream, session=self.session[0])
                )
                if target is not None:
                    self.downstream = target.peer_id  # the micro-batches behind this one follow it
                outbound = None if target is None else self._end_out(target.peer_id)
                if target is not None and batch.mode is Mode.TRAIN:
                    ticket = self.ordinals.issue()
                sent = None if target is None else self.out_links[target.peer_id].take()  # in encoding order
                try:
                    message: Message = await self._compute(self._forward, batch, data, inbound, outbound)
                except BaseException:
                    if target is not None:
                        self._drop_out(target.peer_id)  # the number we took was never sent
                    raise
            if target is None:  # the last stage: gradient (training) or metrics (eval)
                self._measure(batch, time.perf_counter() - started)
                return Outcome(message.kind, message.payload, dict(message.metrics), [self.node.peer_id])
            return await self._downstream(head, batch, message, inbound, target, sent, ticket, started, deadline)
        finally:
            if ticket is not None:
                await self.ordinals.finish(ticket)

    async def _downstream(
        self,
        head,
        batch: MicroBatch,
        message: Message,
        inbound,
        record: StageRecord,
        sent: tuple[int, int],
        ticket,
        started: float,
        deadline: float,
    ) -> Outcome:
        """Sends our activations on (retrying on a reset link or another peer) and runs our backward."""
        elapsed = time.perf_counter() - started
        tried: set[str] = set()
        target = record.peer_id
        for attempt in range(MAX_ATTEMPTS):
            tried.add(target)
            self.pacer.heard(target, record.download_share, fallback=True)
            call = MeteredCall(
                self.node.streams,
                target,
                self._head(batch, target, sent, deadline - time.monotonic()),
                message.payload,
                self.sending,
                self.pacer.flow(target),
                meter=self.replies[target],
            )
            try:
                result, reply = await self._reply(call, max(deadline - time.monotonic(), 0.1))
                self.pacer.heard(target, result.share_bits)
                self.pacer.arrived(target, len(reply))
                break
            except (TransportError, RemoteError) as e:
                self._drop_out(target)
                if isinstance(e, RemoteError) and not e.retry_link:
                    raise
                if attempt + 1 == MAX_ATTEMPTS or time.monotonic() >= deadline:
                    raise
                if isinstance(e, TransportError):
                    self.router.failed(target)
                    try:
                        record = await self.router.choose(self.stage + 1, exclude=tried, session=self.session[0])
                        target = record.peer_id
                    except NoPeerError:
                        raise e from None
                log.warning(
                    "micro-batch %s: stage %d peer failed (%s); retrying on %s",
                    batch.key,
                    self.stage + 1,
                    e,
                    target[-8:],
                )
                outbound = self._end_out(target)
                sent = self.out_links[target].take()
                message = await self._compute(self._resend, batch, outbound, message)
        call.finish()
        self.router.succeeded(target)
        route = [self.node.peer_id, *result.route]
        if result.kind == pb.DONE:
            self._measure(batch, elapsed)
            return Outcome(Kind.DONE, b"", dict(result.metrics), route)
        if result.kind != pb.BACKWARD or ticket is None:
            raise ProtocolError(
                f"stage {self.stage + 1} replied with kind {result.kind} to a {batch.mode.value} micro-batch"
            )
        self.received[(target, "backward", batch.mode.value)] += len(reply)
        async with self.ordinals.turn(ticket, max(deadline - time.monotonic(), 0.1)):
            link, outbound = self.out_links[target], self.ends_out.get(target)
            if outbound is None or link.epoch != sent[0]:
                raise LinkReset(
                    f"the link to stage {self.stage + 1} peer {target[-8:]} was reset while micro-batch {batch.key} was on it"
                )
            started = time.perf_counter()
            try:
                back: Message = await self._compute(
                    self._backward, batch, reply, dict(result.metrics), inbound, outbound
                )
            except BaseException:
                self._drop_out(target)
                raise
        self._measure(batch, elapsed + time.perf_counter() - started)
        return Outcome(back.kind, back.payload, dict(back.metrics), route)

    async def _reply(self, call: MicroBatchCall, timeout: float) -> tuple[pb.ResultHead, bytes]:
        self.awaiting += 1
        try:
            return await call.reply(timeout)
        finally:
            self.awaiting -= 1

    def _head(self, batch: MicroBatch, target: str, sent: tuple[int, int], budget: float) -> pb.MicroBatchHead:
        return pb.MicroBatchHead(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            stage=self.stage + 1,
            sender=self.node.peer_id,
            kind=pb.FORWARD,
            batch=batch_to_meta(batch),
            budget_s=max(budget, 0.1),
            epoch=sent[0],
            seq=sent[1],
            reply_share_bits=self.pacer.offer(target, self._more_from_upstream(batch)),
        )

    def _more_from_upstream(self, batch: MicroBatch) -> bool:
        """Whether activations of this step are still to come from upstream (pacing: what we offer
        downstream for its gradients); the trainer's inputs to stage 0 are not counted."""
        return not self.first and (batch.mode is not Mode.TRAIN or batch.index < self.cfg.train.micro_batches - 1)

    # ---- the synchronous step --------------------------------------------------------------

    def _step(self, head: pb.StepHead, payload: bytes) -> tuple[pb.StepResult, bytes]:
        """Rounds are idempotent: accumulating is repeatable, a retried apply returns the same reply."""
        if head.apply and self._applied is not None and self._applied[0] == head.step:
            return self._applied[1], b""
        switch = (
            switched_config(self.cfg, self.stage, head.codecs) if head.apply and head.codecs else None
        )  # adaptive compression
        if head.save:
            return pb.StepResult(step=head.step), self._save(head.step)
        if head.load:  # with the codecs the checkpoint's links ran (adaptive compression), else the config's
            self.cfg = switched_config(self._configured, self.stage, head.codecs)[0]
            return pb.StepResult(step=self._load(payload)), b""
        runtime = self.runtime
        if head.accumulate:
            try:
                runtime.accumulate([(Mode.TRAIN.value, head.step, i) for i in sorted(head.micro_batches)])
            except KeyError as e:
                raise RemoteError(str(e.args[0])) from None
        for name, grad in payload_to_tensors(head.set_grads, payload).items():
            param = self._param(name)
            if tuple(grad.shape) != tuple(param.shape):
                raise ProtocolError(
                    f"gradient for {name!r} has shape {tuple(grad.shape)}, the parameter {tuple(param.shape)}"
                )
            param.grad = grad.to(param.device, param.dtype).clone()
        names = [name for name, _ in runtime.module.named_parameters()] if head.all_grads else head.get_grads
        grads = {}
        for name in names:
            param = self._param(name)
            if param.grad is not None:
                grads[name] = param.grad.detach()
        slots, data = tensors_to_payload(grads)
        result = pb.StepResult(grads=slots)
        if head.want_norm:
            result.grad_sq_norm = runtime.grad_sq_norm()
        if head.scale:
            runtime.scale_grads(head.scale)
        if head.apply:
            result.lr = runtime.apply_step()
            self.steps += 1
            self._applied = (head.step, result)
            if switch is not None and switch[1]:
                install(self, *switch)
        return result, data

    def _save(self, step: int) -> bytes:
        """This stage as a single-process stage checkpoint, with the links in use as its link ends
        (other neighbours' links restart fresh after a resume) and this process's RNG."""
        from swarm.engine.checkpoint import stage_state

        runtime = self.runtime
        for upstream, ends, neighbour in ((False, self.ends_in, self.upstream), (True, self.ends_out, self.downstream)):
            end = ends.get(neighbour) or self._spare.get(upstream) or next(reversed(ends.values()), None)
            setattr(runtime, "outbound" if upstream else "inbound", end)
        state = stage_state(runtime, step)
        state["rng"] = torch.get_rng_state()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _load(self, blob: bytes) -> int:
        """Installs a stage checkpoint; every link restarts from its saved ends with a new epoch."""
        from swarm.engine.checkpoint import FORMAT, apply_stage_state

        try:
            state = torch.load(io.BytesIO(blob), map_location=self.runtime.device, weights_only=True)
        except Exception as e:
            raise ProtocolError(f"not a stage checkpoint: {str(e).splitlines()[0][:200]}") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ProtocolError(f"not a hivepipe stage checkpoint (format {FORMAT})")
        runtime = self.runtime
        runtime.inbound = None if self.first else self._make_end(False, "checkpoint")
        runtime.outbound = None if self.last else self._make_end(True, "checkpoint")
        try:
            step = apply_stage_state(runtime, state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ProtocolError(f"checkpoint does not fit stage {self.stage}: {str(e).splitlines()[0][:200]}") from None
        if isinstance(state.get("rng"), torch.Tensor):
            torch.set_rng_state(state["rng"])
        runtime.held.clear()
        self._spare = {False: runtime.inbound, True: runtime.outbound}
        for table in (self.ends_in, self.ends_out, self.out_links):
            table.clear()
        self.downstream = self.upstream = None
        self.steps, self._applied = step, None
        return step

    def _param(self, name: str) -> torch.nn.Parameter:
        try:
            return self.runtime.module.get_parameter(name)
        except AttributeError:
            raise ProtocolError(f"stage {self.stage} has no parameter {name!r}") from None

    async def step(self, head: pb.StepHead, payload: bytes) -> tuple[pb.StepResult, bytes]:
        if self.runtime is None:
            raise RemoteError(f"stage {self.stage} of run {self.run_id!r} is not set up yet", pb.NOT_READY)
        return await self._compute(self._counted_step, head, payload)

    def _counted_step(self, head: pb.StepHead, payload: bytes) -> tuple[pb.StepResult, bytes]:
        started = self.compute.start()
        try:
            return self._step(head, payload)
        finally:
            self.compute.stop(started)

    # ---- status ----------------------------------------------------------------------------

    def status(self) -> pb.StageStatus:
        from swarm.transport.hivemind.stage.status import stage_status

        return stage_status(self)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
