"""One stage hosted by a peer: the engine's `StageRuntime` plus what the network adds.

The runtime is the same one the in-process transport drives. The host is where a stage's pieces
are made and wired, nothing more: its typed state (`stage.state`: where it is, what the run has of
it now, what it measured), its computing thread (`stage.work`), one link end per neighbour peer
(`links`), the checks of who may call it (`gate`), and the collaborators that serve its calls,
each given the pieces it uses (`parts`): micro-batches (`chain`: each one's whole trip, from its
admission to its paced reply), the step's rounds and checkpoints
(`rounds`), state for joiners (`source`), the swarm's copies (`snapshots`). It hands micro-batches
on to the next stage (`handoff`) and measures its throughput for the DHT record others route by.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from protocols.version import PROTOCOL_VERSION
from swarm.compression.spec import keeps_state
from swarm.config import ExperimentConfig
from swarm.engine.build import build_runtime, build_staged_model, config_digest, link_ends
from swarm.transport.hivemind.dht.announce import StageRecord
from swarm.transport.hivemind.flow.pacing import FlowPacer, stage_flows
from swarm.transport.hivemind.net.calls import Sending
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.routing.handoff import Handoff, LinkHooks
from swarm.transport.hivemind.routing.router import Router
from swarm.transport.hivemind.stage.chain import Chain
from swarm.transport.hivemind.stage.closing import Closing
from swarm.transport.hivemind.stage.joining import Joining, StateSource
from swarm.transport.hivemind.stage.leaving import drain
from swarm.transport.hivemind.stage.links import NeighbourLinks
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.rounds import StageRounds
from swarm.transport.hivemind.stage.snapshots import Snapshots
from swarm.transport.hivemind.stage.state import PeerServices, StageMeters, StagePlace, StageState
from swarm.transport.hivemind.stage.status import stage_status
from swarm.transport.hivemind.stage.work import StageWork
from swarm.transport.hivemind.trust.gate import Gate

log = logging.getLogger(__name__)


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
        cfg = cfg if device is None else cfg.model_copy(update={"device": device})
        self.place = place = StagePlace(node, run_id, stage, cfg.model.num_stages, config_digest(cfg), token)
        self.state = state = StageState(place, cfg)
        self.meters = StageMeters()
        self.peer = PeerServices()  # the server's, once hosted
        self.work = StageWork(place, state, self.meters)
        self.links = NeighbourLinks(stage, place.num_stages, lambda: state.cfg)
        self.sending = Sending(node.settings.streams.sending_per_neighbour)  # activations down, gradients up
        self.pacer = FlowPacer(node.uplink_bits, node.downlink_bits, stage_flows(stage, place.num_stages))
        self.gate = Gate(run_id, stage, node.peer_id, owner)  # who may call it (the run's owner, its members)
        self.router = Router(node, run_id, self._routable)
        self.router.standby = lambda record: self.gate.verifier(record.peer_id)
        self.handoff = None if place.last else self._handoff()
        if self.handoff is not None:
            self.links.on_restart = self.handoff.restart
        self.parts = StageParts(state, self.meters, self.work, self.links, self.handoff, self.gate, self.peer)
        self.rounds = StageRounds(self.parts)
        self.chain = Chain(self.parts, Closing(self.parts, self.rounds), self.pacer, self.sending)  # micro-batches
        self.source = StateSource(place, state, self.work)  # its state for joiners
        self.snapshots = Snapshots(self.parts, self.rounds)
        self._setup_lock = asyncio.Lock()

    def _handoff(self) -> Handoff:
        hooks = LinkHooks(self.links.drop_out, self.links.replies, self._feedback_out, lambda: self.gate.admission)
        return Handoff(self.router, self.place.stage + 1, self.pacer, self.sending, hooks)

    def attach(self, peer: PeerServices) -> None:
        """Hosted by a server: its events, averager and announcements are the server's."""
        self.peer.events, self.peer.averager, self.peer.changed = peer.events, peer.averager, peer.changed
        self.router.events = peer.events

    @property
    def run_id(self) -> str:
        return self.place.run_id

    @property
    def stage(self) -> int:
        return self.place.stage

    @property
    def node(self) -> SwarmNode:
        return self.place.node

    @property
    def runtime(self):
        return self.state.runtime

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def role(self) -> str:
        return self.state.role

    @property
    def awaiting(self) -> int:
        """Micro-batches whose gradients we wait for from downstream (pacing offers)."""
        return self.handoff.awaiting if self.handoff is not None else 0

    # ---- setup ---------------------------------------------------------------------------

    def _build(self, lr_horizon: int, capacity: int | None):
        cfg = self.state.configured
        with _BUILD_LOCK:
            staged = build_staged_model(cfg)
            runtime = build_runtime(cfg, staged, self.stage, lr_horizon, hold_grads=True)
        self.links.start(capacity, link_ends(cfg, self.stage, capacity))
        self.chain.restart()
        return runtime, staged.tied

    async def setup(self, request: pb.SetupRequest) -> pb.SetupReply:
        """A trainer (re)starts the run: a new session builds the stage afresh. One setup at a time:
        two checked before the owner was known cannot both win (swarm.transport.hivemind.trust.gate)."""
        async with self._setup_lock:
            self.gate.confirm(request)
            return await self._setup(request)

    async def _setup(self, request: pb.SetupRequest) -> pb.SetupReply:
        state, place = self.state, self.place
        if request.config_digest != place.digest:
            raise RemoteError(
                f"config mismatch on stage {self.stage}: this peer has {place.digest}, the trainer {request.config_digest} (start both with the same config and --set)"
            )
        session = (request.session, int(request.lr_horizon), int(request.capacity))
        if state.session != session or state.runtime is None:
            state.stop_joining()
            runtime, tied = await self.work.run(self._build, int(request.lr_horizon), int(request.capacity) or None)
            state.started(session, runtime, tied)
            self.rounds.restart()
            self.meters.set_up()
            how = f" to join from {len(request.sources)} peer(s) in service" if request.sources else ""
            self.peer.events.add("setup", f"stage {self.stage}: set up by trainer session {request.session[:8]}{how}")
            if request.sources:  # mid-run: the state comes from a peer in service
                joining = Joining(self.parts, self.rounds)
                state.follow(joining)
                joining.start(list(request.sources))
        self.gate.set_up(request)
        if self.handoff is not None:  # the owner's checks name the peers we must avoid with it
            self.handoff.check_key = bytes(request.check_key)
        tied = [
            pb.TiedParam(
                first_stage=t.first[0], first_name=t.first[1], second_stage=t.second[0], second_name=t.second[1]
            )
            for t in state.tied
        ]
        return pb.SetupReply(peer_id=place.peer_id, tied=tied)

    def record(self, addrs: list[str]) -> StageRecord:
        state = self.state
        link = state.cfg.compression.link(self.stage - 1) if self.stage > 0 else None
        codecs = {"forward": link.forward, "backward": link.backward} if link else {}
        return StageRecord(
            self.place.peer_id,
            self.stage,
            self.place.num_stages,
            addrs,
            self.meters.throughput,
            self.meters.queue,
            codecs,
            PROTOCOL_VERSION,
            ready=state.role == "serving",
            session=state.session_id,
            leaving=state.leaving,
            download_share=self.pacer.download_share,
            admission=self.gate.admission.SerializeToString() if self.gate.admission is not None else b"",
            token=self.place.token,
            relay=self.place.node.reach.me.relay,
        )

    def _routable(self, record: StageRecord) -> bool:
        """Only peers the run's owner admitted to our session, and still has in its roster, are
        handed micro-batches."""
        session = self.state.session_id
        return self.gate.admissions.routable(
            record.admission, self.gate.owner, session, record.peer_id, record.stage
        ) and self.gate.listed(record.stage, record.peer_id, session)

    # ---- links --------------------------------------------------------------------------------

    def _feedback_out(self) -> bool:
        """Whether the link to the next stage keeps state across micro-batches (error feedback)."""
        link = self.state.cfg.compression.link(self.stage)
        return keeps_state(link.forward, link.backward)

    def status(self) -> pb.StageStatus:
        out = stage_status(self.place, self.state, self.meters, self.links)
        out.states_served, out.state_bytes_out = self.source.served, self.source.bytes_out
        out.sending_s = self.sending.busy.seconds
        out.retries = self.handoff.retries if self.handoff is not None else 0
        out.bans = self.router.banned_total
        self.snapshots.status(out)
        return out

    async def drain(self, say) -> None:
        """Returns once it can leave without its run noticing (stage.leaving)."""
        await drain(self.parts, self.router, self.rounds, say)

    def close(self) -> None:
        self.work.close()
        self.snapshots.close()
        self.state.stop_joining()
