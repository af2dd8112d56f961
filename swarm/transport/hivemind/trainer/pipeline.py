"""`SwarmPipeline`: the trainer's side of the swarm, the engine's `Pipeline` over stage peers, so
that `swarm.training.loop.train` drives a swarm exactly as it drives one process.

The trainer owns data and schedule: it sends micro-batches to stage-0 peers (each chains its
micro-batch through the stages and back: swarm.transport.hivemind.stage.chain), several at once
and numbered on each link so every stage processes them in the trainer's order. After the last
micro-batch of a step it runs the synchronous step (swarm.engine.step) across every stage peer
(`rounds`), or the step closes on the way, with no round trip (trainer.closing). At each step
boundary it sets up the peers that announced themselves for the run since (`admit`): each joins
as a replica that downloads its stage's state from a peer in service (stage.joining) and follows
the step rounds until it serves.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError
from swarm.config import ExperimentConfig
from swarm.engine.build import config_digest
from swarm.engine.pipeline import Rewound
from swarm.engine.step import synchronous_step
from swarm.models import TiedPair
from swarm.transport.hivemind.flow.busy import Busy
from swarm.transport.hivemind.flow.ordering import Numbering
from swarm.transport.hivemind.flow.pacing import FlowPacer
from swarm.transport.hivemind.net.calls import Sending
from swarm.transport.hivemind.net.events import EventLog
from swarm.transport.hivemind.net.loop import LoopThread
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.retry import Retry
from swarm.transport.hivemind.routing.handoff import Handoff, LinkHooks
from swarm.transport.hivemind.routing.router import NoPeerError, Router
from swarm.transport.hivemind.trainer.accounts import Accounts
from swarm.transport.hivemind.trainer.adaptive import AdaptiveCodecs
from swarm.transport.hivemind.trainer.closing import StepClosing
from swarm.transport.hivemind.trainer.dispatch import Dispatch, Entry, micro_batches_in_flight
from swarm.transport.hivemind.trainer.late import DEPTH
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace
from swarm.transport.hivemind.trainer.recovery import Recovery, RecoveryHooks
from swarm.transport.hivemind.trainer.rounds import StepHooks, SwarmRounds, codec_changes
from swarm.transport.hivemind.trainer.setups import Setups
from swarm.transport.hivemind.trust.owner import Owner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunAccess:
    """Who owns the run and who may serve it: the owner's key (None: this process's), the peers
    allowed by name, and whether the run is private (only those, or holders of the owner's tokens)."""

    owner_key: RSAPrivateKey | None = None
    allow: tuple[str, ...] | list[str] = ()
    private: bool = False


class SwarmPipeline:
    def __init__(
        self,
        node: SwarmNode,
        loop: LoopThread,
        cfg: ExperimentConfig,
        run_id: str,
        snapshot_every: int = 0,
        fresh: bool = False,
        access: RunAccess = RunAccess(),
    ) -> None:
        self.cfg = cfg
        num_stages = cfg.model.num_stages
        in_flight = micro_batches_in_flight(cfg.train.in_flight, num_stages, node.settings)
        owner = Owner(access.owner_key or RSAPrivateKey.process_wide(), run_id, access.allow, access.private)
        session = uuid.uuid4().hex
        router = Router(node, run_id, lambda r: self.membership.routable(r), owner.allows)
        events = EventLog()
        router.events = events
        self.place = place = TrainerPlace(
            node, loop, run_id, num_stages, owner, session, router, Retry(node.settings), events
        )
        self.membership = membership = Membership(place)
        membership.verifiers = frozenset(cfg.train.verifiers)
        router.standby = lambda record: record.peer_id in membership.verifiers
        self.position = position = Position()
        self.setups = Setups(place, membership, position, config_digest(cfg), cfg.train)
        self._state = "starting"  # training, finished (recovery says when it is paused, and why)
        self.in_swarm = Busy()  # seconds the training loop waited on the swarm (micro-batches, rounds)
        numbering = Numbering()  # of our messages to each stage-0 peer (the dispatch's)
        pacer = FlowPacer(node.uplink_bits, None, flows=1)  # inputs to stage 0, with a declared --uplink
        admission = lambda: owner.admit(session, node.peer_id, trainer=True)  # noqa: E731
        sending = Sending(node.settings.streams.sending_per_neighbour)
        self.handoff = Handoff(router, 0, pacer, sending, LinkHooks(numbering.restart, admission=admission))
        self.adaptive = AdaptiveCodecs(cfg) if cfg.compression.adaptive is not None else None
        hooks = StepHooks(self.run_again, self.adapt, self.step_done)
        self.rounds = SwarmRounds(place, membership, position, self.adaptive, hooks)
        fixed_codecs = self.adaptive is None
        depth = DEPTH[cfg.train.schedule]
        self.closing = StepClosing(place, membership, self.rounds, cfg.train, fixed_codecs, depth)
        entry = Entry(self.handoff, numbering)
        self.dispatch = Dispatch(place, membership, position, entry, self.closing, in_flight, cfg)
        # the swarm's copies of every stage, every few steps
        recovery_hooks = RecoveryHooks(self.setups.set_up, self.went_back)
        self.recovery = Recovery(
            place, membership, position, self.rounds, self.adaptive, recovery_hooks, snapshot_every
        )
        self.fresh = fresh  # start at step 0 even where the swarm kept copies of an earlier trainer's run
        self._resumed: dict | None = None  # the position of a run taken over from an earlier trainer
        self.accounts = Accounts(place, membership)  # the stage peers' statuses: link bytes, compute, state

    # ---- what others read of it ----------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Micro-batches out at once (the dispatch's window)."""
        return self.dispatch.in_flight

    @property
    def node(self) -> SwarmNode:
        return self.place.node

    @property
    def loop(self) -> LoopThread:
        return self.place.loop

    @property
    def run_id(self) -> str:
        return self.place.run_id

    @property
    def num_stages(self) -> int:
        return self.place.num_stages

    @property
    def session(self) -> str:
        return self.place.session

    @property
    def owner(self) -> Owner:
        return self.place.owner

    @property
    def router(self) -> Router:
        return self.place.router

    @property
    def events(self) -> EventLog:
        return self.place.events

    @property
    def tied(self) -> list[TiedPair]:
        return self.place.tied

    @property
    def members(self) -> dict[int, list[str]]:
        return self.membership.members

    @property
    def following(self) -> set[str]:
        return self.membership.following

    @property
    def step_index(self) -> int:
        return self.position.step_index

    @property
    def state(self) -> str:
        """Its progress record's: starting, training, paused (why), finished (or how it ended:
        the trainer process sets interrupted or failed)."""
        return self.recovery.paused or self._state

    @state.setter
    def state(self, state: str) -> None:
        self._state = state

    # ---- setup -------------------------------------------------------------------------------

    def setup(self, lr_horizon: int, capacity: int | None, wait_s: float | None = None) -> dict[int, list[str]]:
        """Waits (at most `wait_s`, default the settings' setup_wait_s) until every stage has a peer,
        then sets each up for this session; the peers per stage."""
        wait_s = self.node.settings.dht.setup_wait_s if wait_s is None else wait_s
        return self.loop.run(self._setup(lr_horizon, capacity, wait_s))

    async def _setup(self, lr_horizon: int, capacity: int | None, wait_s: float) -> dict[int, list[str]]:
        deadline = time.monotonic() + wait_s
        found = await self.setups.records(self.router, range(self.num_stages), deadline, wait_s)
        self.setups.args = (lr_horizon, capacity or 0)
        available = {s: [r.peer_id for r in records] for s, records in found.items()}
        resume = None if self.fresh else await self.recovery.resume_point(available)
        members, tied = await self.setups.first(self.router, found, deadline, wait_s)
        if tied and not self.tied:
            self.place.tied[:] = [
                TiedPair((t.first_stage, t.first_name), (t.second_stage, t.second_name)) for t in tied
            ]
        self.membership.start(members)
        if resume is not None:  # an earlier trainer's run: it goes on where the swarm's copies are
            self.recovery.lineage, step, sources = resume
            position = await self.recovery.restore(step, sources)
            if position is None:
                raise NoPeerError(
                    f"a stage lost every peer while the run went back to the swarm's copies of step {step}: start the trainer again"
                )
            self._resumed = position
            self.recovery.took_over(position, step)
            text = f"run {self.run_id!r}: the swarm kept copies of every stage at step {step}; resuming there"
            self.events.add("resume", text, logger=log)
        peers = ", ".join(f"stage {s}: {len(p)} peer(s)" for s, p in sorted(self.members.items()))
        self.events.add("setup", f"session {self.session[:8]} set up {peers}")
        self._state = "training"
        return dict(self.members)

    def serving(self, stage: int) -> list[str]:
        """The stage's members in service (not still catching up)."""
        return self.membership.serving(stage)

    async def admit(self) -> list[tuple[int, str]]:
        return await self.setups.admit(settle=self.closing.settle)

    def drop(self, stage: int, peer: str, why: str, left: bool = False) -> None:
        self.membership.drop(stage, peer, why, left)

    # ---- micro-batches -----------------------------------------------------------------------

    def run_many(self, items, following=()) -> list[dict[str, float]]:
        """Metrics of each (micro-batch, inputs), `in_flight` of them in the pipeline at a time;
        `following`: the next step's, started behind them (train.schedule async: trainer.dispatch)."""
        items = list(items)
        self.accounts.step_statuses = None
        return self._mended(lambda: self.loop.run(self.dispatch.run_many(items, following=list(following))))

    def _mended(self, work):
        """`work()`; if it failed because a stage lost its last peer (or an asynchronous micro-batch
        came again too late), every stage goes back to the swarm's copies (trainer.recovery) and
        the loop hears where from (`Rewound`)."""
        with self.in_swarm.during():  # a pause waits on the swarm too
            try:
                return work()
            except (TransportError, RemoteError, NoPeerError) as e:
                position = self.loop.run(self.recovery.recover(e))
                if position is None:
                    raise
                raise Rewound(position) from None

    async def run_again(self, indices: list[int]) -> None:
        """This step's micro-batches `indices` once more (a peer that ran them left)."""
        await self.dispatch.run_many([self.position.sent[i] for i in indices], again=True)

    # ---- the synchronous step ----------------------------------------------------------------

    def step(self) -> float:
        """The step's learning rate: the step closed on the way when it could (trainer.closing),
        else by the rounds."""
        grad_clip = self.cfg.optimizer.grad_clip
        lr = self.closing.close(self.step_index, grad_clip, self.handoff.retries)
        if lr is not None:
            self._mended(self.step_done)
            return lr
        if self.closing.depth > 1:  # an asynchronous step is applied late: its norms by a round
            lr = self._mended(lambda: self.loop.run(self.closing.late_round(self.step_index, grad_clip)))
            self._mended(lambda: self.loop.run(self.closing.switch(self.step_index, self.adapt)))
            self._mended(self.step_done)
            return lr
        return self._mended(lambda: synchronous_step(self.rounds, self.tied, grad_clip))

    def settle(self) -> None:
        """Every stage applies the last step now (a step closed on the way is applied when the next
        one's micro-batches arrive)."""
        self.settled(lambda: None)

    def settled(self, work):
        """`work()` once every stage applied the last step (its decision may be pending)."""

        def after_settling():
            self.loop.run(self.closing.settle())
            return work()

        return self._mended(after_settling)

    def drains(self, step: int) -> bool:  # an asynchronous run's copies, joiners and codec changes
        adapts = self.adaptive is not None and self.adaptive.due(step)
        return adapts or self.recovery.due(step) or self.loop.run(self.setups.waiting())

    def snapshot(self, step: int, position: dict) -> None:
        if self.recovery.due(step):
            self.settled(lambda: self.loop.run(self.recovery.snapshot(step, position)))

    def resumed(self) -> dict | None:
        return self._resumed

    def finish(self) -> None:
        """The run is done: the copies the swarm kept of it go."""
        self._state = "finished"
        self.loop.run(self.closing.settle())
        self.loop.run(self.recovery.discard())

    async def went_back(self, step: int) -> None:
        """Every stage was restored to `step` (a checkpoint or the swarm's copies): every link
        restarts (new epochs), this step starts over, and what was started ahead of it goes; an
        asynchronous run's last decision is made again (trainer.closing)."""
        await self.dispatch.abandon()
        self.position.went_back(step)
        self.following.clear()
        self.dispatch.numbering.clear()
        await self.closing.reopen(step, self.cfg.optimizer.grad_clip)

    def step_done(self) -> None:
        self.position.next_step()
        self.loop.run(self.setups.boundary(self.closing.settle, drained=self.dispatch.ahead is None))

    async def adapt(self) -> list[pb.BoundaryCodecs]:
        """compression.adaptive: the boundaries whose codecs change from the next step on (every
        peer of both stages of such a boundary switches in this step's apply round)."""
        if self.adaptive is None:
            return []
        self.adaptive.step_done()
        if not self.adaptive.due(self.step_index + 1):
            return []
        # after the last micro-batch: also this step's link bytes
        statuses = self.accounts.step_statuses = await self.accounts.statuses()
        changes = self.adaptive.observe(statuses, self.step_index + 1)
        for boundary in changes:
            decision = self.adaptive.last[boundary].describe()
            self.events.add("codec", f"after step {self.step_index + 1}: adaptive compression, {decision}", logger=log)
        return codec_changes(changes)

    def step_notes(self) -> dict:
        """Extra fields of a step's results row: the codecs that step ran with (adaptive compression),
        and every stage peer's compute so far (with link_bytes' statuses), so that figures over some
        steps (bench throughput leaves the warm-up out) take the compute of the same steps."""
        notes = {"codecs": self.adaptive.ran} if self.adaptive is not None else {}
        if (stages := self.accounts.compute_notes()) is not None:
            notes["stages"] = stages
        return notes

    def summary_notes(self) -> dict:
        """The summary row's account of the swarm's copies and pauses, the step rounds' payload
        bytes, and of adaptive compression: every change, and the latest decisions."""
        notes = {**self.recovery.notes(), "round_bytes": dict(self.rounds.payload_bytes)}
        notes["round_calls"] = dict(self.rounds.calls)
        notes["closed_on_the_way"] = self.closing.closed
        notes.update(self.dispatch.notes())
        return notes if self.adaptive is None else {**notes, "adaptive": self.adaptive.summary()}

    def adaptive_report(self) -> str | None:
        return self.adaptive.report() if self.adaptive is not None else None

    # ---- accounting --------------------------------------------------------------------------

    def statuses(self) -> list[pb.StageStatus]:
        return self.loop.run(self.accounts.statuses())

    def link_bytes(self) -> dict[str, int]:
        return self.accounts.link_bytes()

    def stage_rows(self) -> list[dict]:
        """Per stage peer: training compute seconds, its computing thread's CPU seconds and samples
        (a throughput benchmark's compute bound)."""
        keys = ("stage", "compute_s", "compute_cpu_s", "samples", "processed", "throughput")
        return [{key: getattr(status, key) for key in keys} for status in self.statuses()]

    def state_bytes(self) -> int:
        return sum(status.state_bytes for status in self.statuses())

    # ---- checkpoints: the single-process format, so either transport can resume them ----------

    def save_checkpoint(self, directory, step: int) -> None:
        self.settled(lambda: self.loop.run(self.rounds.save(Path(directory), step)))

    def load_checkpoint(self, directory) -> int:
        step, saved = self.loop.run(self.rounds.load(Path(directory)))
        if saved is not None:
            self.adaptive.restore(saved)
        self.loop.run(self.went_back(step))
        return step
