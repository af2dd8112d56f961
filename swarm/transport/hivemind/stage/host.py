"""One stage hosted by a peer: the engine's `StageRuntime` plus what the network adds.

The runtime is the same one the in-process transport drives; the host gives it one link end per
neighbour peer (`links`), runs its computing on one thread of its own (`compute`), and serves the
stage's calls: setup by the trainer, micro-batches (`chain`), the step's rounds and checkpoints
(`rounds`), its status (`status`). It hands micro-batches on to the next stage (`handoff`) and
measures its throughput for the DHT record others route by.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from protocols import stage_pb2 as pb
from protocols import wire
from protocols.version import PROTOCOL_VERSION
from swarm.compression.spec import parse
from swarm.config import ExperimentConfig
from swarm.engine.build import build_runtime, build_staged_model, config_digest, link_ends
from swarm.engine.linkend import LinkEnd, LinkEnds
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.transport.hivemind.announce import StageRecord
from swarm.transport.hivemind.busy import Busy
from swarm.transport.hivemind.calls import Sending
from swarm.transport.hivemind.errors import RemoteError
from swarm.transport.hivemind.events import EventLog
from swarm.transport.hivemind.handoff import Handoff
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.pacing import FlowPacer, stage_flows
from swarm.transport.hivemind.routing import Router
from swarm.transport.hivemind.stage.chain import Chain
from swarm.transport.hivemind.stage.clock import ComputeClock
from swarm.transport.hivemind.stage.joining import Joining, StateSource
from swarm.transport.hivemind.stage.links import NeighbourLinks
from swarm.transport.hivemind.stage.rounds import StageRounds
from swarm.transport.hivemind.stage.snapshots import Snapshots
from swarm.transport.hivemind.stage.status import stage_status
from swarm.transport.hivemind.trust.gate import Gate

log = logging.getLogger(__name__)


@functools.cache
def _has_feedback(*specs: str) -> bool:
    """Whether any of these codec specs keeps state across micro-batches (asked per micro-batch)."""
    return any(parse(spec).feedback is not None for spec in specs)


_BUILD_LOCK = threading.Lock()  # models are built under the global torch seed: one build at a time per process


class HostedStage:
    def __init__(
        self,
        node: SwarmNode,
        run_id: str,
        cfg: ExperimentConfig,
        stage: int,
        device: str | None = None,
        owner: str | None = None,
        token: bytes = b"",
    ) -> None:
        if not 0 <= stage < cfg.model.num_stages:
            raise ValueError(
                f"stage {stage} does not exist: the config has {cfg.model.num_stages} stages (0..{cfg.model.num_stages - 1})"
            )
        self.node, self.run_id, self.stage = node, run_id, stage
        self.settings = node.settings
        self.cfg = cfg if device is None else cfg.model_copy(update={"device": device})
        self.configured = self.cfg  # what a new trainer session starts from (adaptive codecs change self.cfg)
        self.num_stages = cfg.model.num_stages
        self.digest = config_digest(cfg)
        self.link_grace = self.settings.link_grace_s
        self.runtime = None
        self.session: tuple | None = None  # (trainer session, lr horizon, capacity) it was set up for
        self.tied: list = []
        self.links = NeighbourLinks(stage, lambda: self.cfg)
        self.sending = Sending(self.settings.sending_per_neighbour)  # activations down, gradients up
        self.pacer = FlowPacer(node.uplink_bits, node.downlink_bits, stage_flows(stage, self.num_stages))
        self.gate = Gate(run_id, stage, node.peer_id, owner)  # who may call it (the run's owner, its members)
        self.token = token  # a private run's allowance (serialized pb.Token), shown in its record
        self._setup_lock = asyncio.Lock()
        self.events = EventLog()  # the server's, once hosted (its status shows them)
        self.router = Router(node, run_id, self._routable)
        self.router.events = self.events
        self.handoff = None
        if not self.last:
            self.handoff = Handoff(
                node,
                self.router,
                run_id,
                stage + 1,
                self.pacer,
                self.sending,
                self.links.drop_out,
                self.links.replies,
                self._feedback_out,
                lambda: self.gate.admission,
            )
        self.chain = Chain(self)
        self.rounds = StageRounds(self)
        self.joining: Joining | None = None  # set up mid-run: catching up (swarm.transport.hivemind.stage.joining)
        self.joined: tuple[int, int, float] | None = None  # (step, state bytes, seconds) of its join
        self.set_up_at = 0.0  # when it was set up (monotonic): a joiner's first micro-batch is timed from it
        self.serving_since = 0.0  # when it was first set up (monotonic): its idle seconds count from then
        self.occupied = Busy()  # seconds with a micro-batch in this stage (the rest since set up: idle)
        self.first_batch_s: float | None = None  # seconds from being set up to the first micro-batch
        self.source = StateSource(self)  # its state for joiners
        self.snapshots = Snapshots(self)  # the swarm's copies it keeps (its stage's and a neighbour's)
        self.leaving = False  # draining: it takes no new micro-batch and leaves after this step
        self.changed = lambda: None  # its record changed (the server announces it at once)
        self.averager = None  # the server's ReplicaAverager: gradients summed with the peers sharing them
        self.clock = ComputeClock()  # training compute (the compute bounds of throughput benchmarks)
        self.throughput = 0.0
        self.queue = 0
        self.peak_queue = 0  # most micro-batches inside this stage at once
        self.processed = 0
        self.steps = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}")
        self._closed = False

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def awaiting(self) -> int:
        """Micro-batches whose gradients we wait for from downstream (pacing offers)."""
        return self.handoff.awaiting if self.handoff is not None else 0

    @property
    def session_id(self) -> str:
        return self.session[0] if self.session else ""

    @property
    def role(self) -> str:
        if self.runtime is None:
            return "idle"
        if self.joining is not None:
            return "following"
        return "leaving" if self.leaving else "serving"

    # ---- setup ---------------------------------------------------------------------------

    def _build(self, lr_horizon: int, capacity: int | None) -> None:
        with _BUILD_LOCK:
            staged = build_staged_model(self.cfg)
            runtime = build_runtime(self.cfg, staged, self.stage, lr_horizon, hold_grads=True)
        self.links.start(capacity, link_ends(self.cfg, self.stage, capacity))
        self.chain.restart()
        self.tied = list(staged.tied)
        self.runtime = runtime

    async def setup(self, request: pb.SetupRequest) -> pb.SetupReply:
        """A trainer (re)starts the run: a new session builds the stage afresh. One setup at a time:
        two checked before the owner was known cannot both win (swarm.transport.hivemind.trust.gate)."""
        async with self._setup_lock:
            self.gate.confirm(request)
            return await self._setup(request)

    async def _setup(self, request: pb.SetupRequest) -> pb.SetupReply:
        if request.config_digest != self.digest:
            raise RemoteError(
                f"config mismatch on stage {self.stage}: this peer has {self.digest}, the trainer {request.config_digest} (start both with the same config and --set)"
            )
        session = (request.session, int(request.lr_horizon), int(request.capacity))
        if self.session != session or self.runtime is None:
            if self.joining is not None:
                self.joining.cancel()
            self.joining = self.joined = None
            self.cfg = self.configured
            await self.compute(self._build, int(request.lr_horizon), int(request.capacity) or None)
            self.session = session
            self.steps = 0
            self.rounds.restart()
            self.set_up_at, self.first_batch_s = time.monotonic(), None
            self.serving_since = self.serving_since or self.set_up_at
            how = f" to join from {len(request.sources)} peer(s) in service" if request.sources else ""
            self.events.add("setup", f"stage {self.stage}: set up by trainer session {request.session[:8]}{how}")
            if request.sources:  # mid-run: the state comes from a peer in service
                self.joining = Joining(self, list(request.sources))
                self.joining.start()
        self.gate.set_up(request)
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
        return StageRecord(
            self.node.peer_id,
            self.stage,
            self.num_stages,
            addrs,
            self.throughput,
            self.queue,
            codecs,
            PROTOCOL_VERSION,
            ready=self.role == "serving",
            session=self.session_id,
            leaving=self.leaving,
            download_share=self.pacer.download_share,
            admission=self.gate.admission.SerializeToString() if self.gate.admission is not None else b"",
            token=self.token,
        )

    def _routable(self, record: StageRecord) -> bool:
        """Only peers the run's owner admitted to our session are handed micro-batches."""
        return self.gate.admissions.routable(
            record.admission, self.gate.owner, self.session_id, record.peer_id, record.stage
        )

    # ---- links --------------------------------------------------------------------------------

    def _feedback_out(self) -> bool:
        """Whether the link to the next stage keeps state across micro-batches (error feedback)."""
        link = self.cfg.compression.link(self.stage)
        return _has_feedback(link.forward, link.backward)

    def drop_out(self, receiver: str) -> None:
        """Our link to `receiver` lost its order or state: its next message starts a new epoch, and
        the next micro-batch's peer is chosen afresh."""
        self.links.drop_out(receiver)
        if self.handoff is not None:
            self.handoff.forget(receiver)

    def switch_codecs(self, cfg: ExperimentConfig, changed: list[int]) -> None:
        """Adaptive compression: `cfg`'s codecs from now on; the ends of the `changed` boundaries go."""
        self.cfg = cfg
        for boundary in changed:
            link = cfg.compression.link(boundary)
            self.events.add("codec", f"boundary {boundary}: {link.forward} forward, {link.backward} backward")
        self.links.switch(changed)
        if self.handoff is not None and self.stage in changed:
            self.handoff.sticky = None

    def fresh_ends(self, label: str, cfg: ExperimentConfig) -> LinkEnds:
        """New ends of this stage's own (one per side it has) with `cfg`'s codecs."""
        return LinkEnds(
            None if self.first else self.links.make(False, label, cfg),
            None if self.last else self.links.make(True, label, cfg),
        )

    def restored(self, cfg: ExperimentConfig, own: LinkEnds, step: int) -> None:
        """A checkpoint was loaded into the runtime and `own` ends (with `cfg`'s codecs): every link
        restarts from them with a new epoch."""
        self.cfg = cfg
        self.links.restore(own)
        if self.handoff is not None:
            self.handoff.sticky = None
        self.steps = step

    # ---- computing, on the stage's own thread ------------------------------------------------

    async def compute(self, fn, *args):
        """`fn(*args)` on the stage's computing thread, one call after another in the order asked.
        The call is submitted before this coroutine first suspends: a caller that takes a link
        number and then awaits this keeps numbers and encodings in the same order."""
        if self._closed:  # a call that came in while the peer shuts down: another peer may take it
            raise RemoteError(f"stage {self.stage} peer is shutting down", pb.UNAVAILABLE)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def forward(self, batch: MicroBatch, data, ends: LinkEnds) -> Message:
        started = self.clock.start()
        message = self.runtime.forward(batch, data, ends)
        message.delivered()  # link state commits on encoding; a failed delivery resets the link
        if batch.mode is Mode.TRAIN:
            self.clock.stop(started, batch.size)
        return message

    def backward(self, batch: MicroBatch, payload: bytes, metrics: dict, ends: LinkEnds) -> Message:
        started = self.clock.start()
        gradient = wire.decode(payload, self.settings.decode_limits)
        message = self.runtime.backward(batch, gradient, metrics, ends)
        message.delivered()
        self.clock.stop(started)
        return message

    def resend(self, batch: MicroBatch, outbound: LinkEnd, message: Message) -> Message:
        """The same activations for a new link: re-encoded against its fresh state."""
        if batch.mode is Mode.EVAL:
            return message  # stateless encoding: valid on any link
        out = outbound.send(batch, self.runtime.activations(batch))
        out.commit()
        return Message(Kind.FORWARD, self.stage + 1, batch, out.payload)

    def measure(self, batch: MicroBatch, seconds: float) -> None:
        if seconds > 0:
            rate = batch.size / seconds
            self.throughput = rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * rate

    # ---- calls -----------------------------------------------------------------------------

    def ready(self) -> None:
        if self.runtime is None:
            raise RemoteError(f"stage {self.stage} of run {self.run_id!r} is not set up yet", pb.NOT_READY)

    def serving(self, batch: MicroBatch, proof: pb.StepProof | None = None) -> None:
        """Whether this peer takes `batch`: in service (not joining, not leaving), its weights at
        the micro-batch's step. A peer behind the run missed a step's rounds (its trainer left it out
        after a failure): shown so by the owner's `proof`, it goes idle, and the trainer sets it up
        afresh as a joiner."""
        if self.joining is not None or self.leaving:
            raise RemoteError(f"stage {self.stage} peer is {self.role}: it takes no micro-batch", pb.UNAVAILABLE)
        if batch.step != self.steps:
            if (
                batch.step > self.steps
                and proof is not None
                and self.gate.step_shown(proof, self.session_id, batch.step)
            ):
                self.abandon_join(f"it is at step {self.steps}, the run at step {batch.step}")
            raise RemoteError(
                f"stage {self.stage} peer is at step {self.steps}, micro-batch {batch.key} of step {batch.step}",
                pb.UNAVAILABLE,
            )
        if self.first_batch_s is None:
            self.first_batch_s = time.monotonic() - self.set_up_at
            if self.joined is not None:
                log.info(
                    "stage %d: first micro-batch %.1fs after it was set up to join", self.stage, self.first_batch_s
                )

    def abandon_join(self, reason: str) -> None:
        """Out of the run until its trainer sets it up again (as a joiner)."""
        self.events.add(
            "leave", f"stage {self.stage} of run {self.run_id!r} leaves the session: {reason}", logging.WARNING, log
        )
        if self.joining is not None and self.joining.task is not asyncio.current_task():
            self.joining.cancel()
        self.joining = None
        self.runtime = None
        self.session = None
        self.changed()

    def status(self) -> pb.StageStatus:
        return stage_status(self)

    def close(self) -> None:
        self._closed = True
        self.snapshots.close()
        if self.joining is not None:
            self.joining.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
