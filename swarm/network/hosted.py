"""One stage hosted by a peer: the engine's `StageRuntime` plus what the network adds.

The runtime is the same one the in-process transport drives; this wrapper gives it one link end
per neighbour peer (so error-feedback state and reused TopK indices are keyed by the pair, and a
new neighbour starts fresh), calls the next stage's peer, and measures throughput. A micro-batch
runs as a chain: forward here, the downstream call (whose reply is the gradient), backward here,
and the result goes back to the caller, so forward and backward of a micro-batch always use the
same pair of peers on every boundary.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from protocols import stage_pb2 as pb
from swarm.config import ExperimentConfig
from swarm.engine.linkend import LinkEnd
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.network import PROTOCOL_VERSION
from swarm.network.announce import StageRecord
from swarm.network.calls import MicroBatchCall, RemoteError, TransportError
from swarm.network.chunks import ProtocolError
from swarm.network.meta import batch_to_meta, meta_to_batch, payload_to_tensors, raw_to_tensor, tensors_to_payload
from swarm.network.node import SwarmNode
from swarm.network.routing import NoPeerError, Router

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
_BUILD_LOCK = threading.Lock()  # models are built under the global torch seed: one build at a time per process


def config_digest(cfg: ExperimentConfig) -> str:
    """What a stage's computation depends on; trainer and stage must agree on it."""
    data = cfg.model_dump(mode="json", include={"seed", "model", "optimizer", "compression"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Outcome:
    """A processed micro-batch: the reply for the caller and what to do once it is confirmed."""

    kind: Kind
    payload: bytes = b""
    metrics: dict[str, float] = field(default_factory=dict)
    route: list[str] = field(default_factory=list)
    commit: Callable[[], None] = lambda: None


class HostedStage:
    def __init__(self, node: SwarmNode, run_id: str, cfg: ExperimentConfig, stage: int, device: str | None = None, timeout: float = 120.0) -> None:
        if not 0 <= stage < cfg.model.num_stages:
            raise ValueError(f"stage {stage} does not exist: the config has {cfg.model.num_stages} stages (0..{cfg.model.num_stages - 1})")
        self.node, self.run_id, self.stage = node, run_id, stage
        self.cfg = cfg if device is None else cfg.model_copy(update={"device": device})
        self.num_stages = cfg.model.num_stages
        self.digest = config_digest(cfg)
        self.timeout = timeout
        self.router = Router(node, run_id)
        self.runtime = None
        self.setup_key: tuple | None = None
        self.tied: list = []
        self.capacity: int | None = None
        self.ends_in: dict[str, LinkEnd] = {}
        self.ends_out: dict[str, LinkEnd] = {}
        self._spare: dict[bool, LinkEnd | None] = {}
        self.received: Counter = Counter()  # (neighbour, direction, mode) -> bytes
        self.downstream: str | None = None
        self.throughput = 0.0
        self.queue = 0
        self.processed = 0
        self.steps = 0
        self._applied: tuple[int, pb.StepResult] | None = None
        self._settled: asyncio.Event | None = None
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
            runtime = build_runtime(self.cfg, staged, self.stage, lr_horizon, capacity)
        self._spare = {False: runtime.inbound, True: runtime.outbound}
        self.ends_in.clear()
        self.ends_out.clear()
        self.received.clear()
        self.tied = list(staged.tied)
        self.capacity = capacity
        self.runtime = runtime

    async def setup(self, request: pb.SetupRequest) -> pb.SetupReply:
        if request.config_digest != self.digest:
            raise RemoteError(f"config mismatch on stage {self.stage}: this peer has {self.digest}, the trainer {request.config_digest} (start both with the same config and --set)")
        key = (int(request.lr_horizon), int(request.capacity))
        if self.setup_key != key or self.runtime is None:
            capacity = int(request.capacity) or None
            await self._compute(self._build, int(request.lr_horizon), capacity)
            self.setup_key = key
            self.steps = 0
            self._applied = None
        tied = [pb.TiedParam(first_stage=t.first[0], first_name=t.first[1], second_stage=t.second[0], second_name=t.second[1]) for t in self.tied]
        return pb.SetupReply(peer_id=self.node.peer_id, tied=tied)

    def record(self, addrs: list[str]) -> StageRecord:
        link = self.cfg.compression.link(self.stage - 1) if self.stage > 0 else None
        codecs = {"forward": link.forward, "backward": link.backward} if link else {}
        return StageRecord(self.node.peer_id, self.stage, self.num_stages, addrs, self.throughput, self.queue, codecs, PROTOCOL_VERSION, ready=self.runtime is not None)

    # ---- link ends per neighbour ---------------------------------------------------------

    def _new_end(self, upstream: bool, neighbour: str) -> LinkEnd:
        spare = self._spare.get(upstream)
        if spare is not None:
            self._spare[upstream] = None
            return spare
        boundary = self.stage if upstream else self.stage - 1
        link = self.cfg.compression.link(boundary)
        store = self.cfg.compression.store_dir
        store = None if store is None else f"{store}/{neighbour[-12:]}"
        return LinkEnd(boundary, upstream, link.forward, link.backward, store, self.cfg.compression.store_capacity or self.capacity)

    def _end_in(self, sender: str, fresh: bool) -> LinkEnd:
        end = self.ends_in.get(sender)
        if end is None:
            end = self.ends_in[sender] = self._new_end(False, sender)
        elif fresh:
            end.reset()
        return end

    def _end_out(self, receiver: str) -> tuple[LinkEnd, bool]:
        end = self.ends_out.get(receiver)
        if end is None:
            end = self.ends_out[receiver] = self._new_end(True, receiver)
            return end, True
        return end, False

    # ---- compute ---------------------------------------------------------------------------

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _with_ends(self, inbound, outbound, fn, *args):
        self.runtime.inbound, self.runtime.outbound = inbound, outbound
        return fn(*args)

    def _measure(self, batch: MicroBatch, seconds: float) -> None:
        if seconds > 0:
            rate = batch.size / seconds
            self.throughput = rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * rate

    # ---- one micro-batch -------------------------------------------------------------------

    async def micro_batch(self, head: pb.MicroBatchHead, payload: bytes, sender: str) -> Outcome:
        """Forward here, then downstream and backward here; the reply for `sender`."""
        if self.runtime is None:
            raise RemoteError(f"stage {self.stage} of run {self.run_id!r} is not set up yet (the trainer sets stages up when it starts)")
        if head.kind != pb.FORWARD:
            raise ProtocolError(f"rpc_forward expects a FORWARD head, got kind {head.kind}")
        batch = meta_to_batch(head.batch)
        if self._settled is not None:  # the previous reply's state commits before we go on
            try:
                await asyncio.wait_for(self._settled.wait(), self.timeout)
            except TimeoutError:
                pass
        settled = self._settled = asyncio.Event()
        self.queue += 1
        try:
            outcome = await self._chain(head, batch, payload, sender)
        except BaseException:
            settled.set()
            await self._compute(self.runtime.drop, batch)
            raise
        finally:
            self.queue -= 1
        commit = outcome.commit

        def settle(confirmed: bool) -> None:
            if confirmed:
                commit()
            elif not self.first:
                self.ends_in.pop(sender, None)  # unconfirmed state: start afresh with this neighbour
            settled.set()

        outcome.commit = settle
        self.processed += 1
        return outcome

    async def _chain(self, head: pb.MicroBatchHead, batch: MicroBatch, payload: bytes, sender: str) -> Outcome:
        started = time.perf_counter()
        if self.first:
            inputs = pb.RawTensor()
            inputs.ParseFromString(payload)
            data = raw_to_tensor(inputs, "stage 0 input")
            inbound = None
        else:
            data = payload
            inbound = self._end_in(sender, head.fresh_link)
            self.received[(sender, "forward", batch.mode.value)] += len(payload)
        target = None if self.last else await self.router.choose(self.stage + 1, sticky=self.downstream)
        outbound, fresh = (None, False) if target is None else self._end_out(target.peer_id)
        message: Message = await self._compute(self._with_ends, inbound, outbound, self.runtime.forward, batch, data)
        elapsed = time.perf_counter() - started
        if message.kind is not Kind.FORWARD:  # the last stage: gradient (training) or metrics (eval)
            self._measure(batch, elapsed)
            return Outcome(message.kind, message.payload, dict(message.metrics), [self.node.peer_id], message.delivered)

        budget = head.budget_s or self.timeout
        deadline = time.monotonic() + budget - 1.0
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            tried.add(target.peer_id)
            call = MicroBatchCall(self.node.p2p, target.peer_id, self._head(batch, message.payload, fresh, deadline - time.monotonic()), message.payload)
            try:
                result, reply = await call.reply(max(deadline - time.monotonic(), 0.1))
                break
            except TransportError as e:
                self.router.failed(target.peer_id)
                self.ends_out.pop(target.peer_id, None)
                self.downstream = None
                if attempt + 1 == MAX_ATTEMPTS or time.monotonic() >= deadline:
                    raise
                try:
                    target = await self.router.choose(self.stage + 1, exclude=tried)
                except NoPeerError:
                    raise e from None
                log.warning("stage %d peer failed (%s); retrying on %s", self.stage + 1, e, target.peer_id[-8:])
                outbound, fresh = self._end_out(target.peer_id)
                message = await self._compute(self._resend, batch, outbound, message)
            except RemoteError:
                self.ends_out.pop(target.peer_id, None)  # its state may have moved: start afresh next time
                self.downstream = None
                raise
        self.router.succeeded(target.peer_id)
        self.downstream = target.peer_id
        message.delivered()  # the downstream stage processed our activations
        route = [self.node.peer_id, *result.route]
        if result.kind == pb.DONE:
            await call.confirm()
            self._measure(batch, elapsed)
            return Outcome(Kind.DONE, b"", dict(result.metrics), route)
        if result.kind != pb.BACKWARD:
            await call.close()
            raise ProtocolError(f"stage {self.stage + 1} replied with kind {result.kind}, expected BACKWARD or DONE")
        self.received[(target.peer_id, "backward", batch.mode.value)] += len(reply)
        started = time.perf_counter()
        try:
            back: Message = await self._compute(self._with_ends, inbound, outbound, self.runtime.backward, batch, reply, dict(result.metrics))
        except BaseException:
            await call.close()
            self.ends_out.pop(target.peer_id, None)
            raise
        await call.confirm()
        self._measure(batch, elapsed + time.perf_counter() - started)
        return Outcome(back.kind, back.payload, dict(back.metrics), route, back.delivered)

    def _resend(self, batch: MicroBatch, outbound: LinkEnd, message: Message) -> Message:
        """The same activations for a new neighbour: re-encoded against its fresh link state."""
        self.runtime.outbound = outbound
        if batch.mode is Mode.EVAL:
            return message  # stateless encoding: valid for any neighbour
        saved = self.runtime._saved.get(batch.key)
        if saved is None:
            raise RuntimeError(f"stage {self.stage} lost the activations of micro-batch {batch.key}")
        out = outbound.send(batch, saved[1].detach())
        return Message(Kind.FORWARD, self.stage + 1, batch, out.payload, delivered=out.commit)

    def _head(self, batch: MicroBatch, payload: bytes, fresh: bool, budget: float) -> pb.MicroBatchHead:
        return pb.MicroBatchHead(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            stage=self.stage + 1,
            sender=self.node.peer_id,
            kind=pb.FORWARD,
            batch=batch_to_meta(batch),
            fresh_link=fresh,
            budget_s=max(budget, 0.1),
        )

    # ---- the synchronous step --------------------------------------------------------------

    def _step(self, head: pb.StepHead, payload: bytes) -> tuple[pb.StepResult, bytes]:
        """Rounds are idempotent: a retried apply for a step already taken returns the same reply."""
        if head.apply and self._applied is not None and self._applied[0] == head.step:
            return self._applied[1], b""
        runtime = self.runtime
        for name, grad in payload_to_tensors(head.set_grads, payload).items():
            param = self._param(name)
            if tuple(grad.shape) != tuple(param.shape):
                raise ProtocolError(f"gradient for {name!r} has shape {tuple(grad.shape)}, the parameter {tuple(param.shape)}")
            param.grad = grad.to(param.device, param.dtype).clone()
        grads = {}
        for name in head.get_grads:
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
        return result, data

    def _param(self, name: str) -> torch.nn.Parameter:
        try:
            return self.runtime.module.get_parameter(name)
        except AttributeError:
            raise ProtocolError(f"stage {self.stage} has no parameter {name!r}") from None

    async def step(self, head: pb.StepHead, payload: bytes) -> tuple[pb.StepResult, bytes]:
        if self.runtime is None:
            raise RemoteError(f"stage {self.stage} of run {self.run_id!r} is not set up yet")
        if self._settled is not None:
            await asyncio.wait_for(self._settled.wait(), self.timeout)
        return await self._compute(self._step, head, payload)

    # ---- status ----------------------------------------------------------------------------

    def status(self) -> pb.StageStatus:
        out = pb.StageStatus(run_id=self.run_id, stage=self.stage, num_stages=self.num_stages, ready=self.runtime is not None, throughput=self.throughput, queue=self.queue, processed=self.processed, steps=self.steps)
        if self.stage > 0:
            link = self.cfg.compression.link(self.stage - 1)
            out.forward_codec, out.backward_codec = link.forward, link.backward
        if self.runtime is None:
            return out
        out.state_bytes = sum(end.state_bytes for end in (*self.ends_in.values(), *self.ends_out.values()))
        for upstream, ends in ((False, self.ends_in), (True, self.ends_out)):
            for neighbour, end in ends.items():
                link = out.links.add(neighbour=neighbour, boundary=end.boundary, upstream=upstream)
                for (mode, direction), n in end.bytes.items():
                    link.sent[f"{direction}.{mode}"] = n
                for (peer, direction, mode), n in self.received.items():
                    if peer == neighbour:
                        link.received[f"{direction}.{mode}"] = n
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
