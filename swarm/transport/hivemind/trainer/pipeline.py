"""`SwarmPipeline`: the trainer's side of the swarm, the engine's `Pipeline` over stage peers, so
that `swarm.training.loop.train` drives a swarm exactly as it drives one process.

The trainer owns data and schedule: it sends micro-batches to stage-0 peers (each chains its
micro-batch through the stages and back: swarm.transport.hivemind.stage.chain), several at once
and numbered on each link so every stage processes them in the trainer's order. After the last
micro-batch of a step it runs the synchronous step (swarm.engine.step) across every stage peer
(`rounds`). At each step boundary it sets up the peers that announced themselves for the run since
(`admit`): each joins as a replica that first downloads its stage's state from a peer in service
(swarm.transport.hivemind.stage.joining) and follows the step rounds until it serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from pathlib import Path

import torch
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from swarm.config import ExperimentConfig
from swarm.engine.build import config_digest
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.engine.pipeline import Rewound
from swarm.engine.step import synchronous_step
from swarm.models import TiedPair
from swarm.transport.hivemind.busy import Busy
from swarm.transport.hivemind.calls import Sending, call
from swarm.transport.hivemind.errors import RemoteError, TransportError, one_line
from swarm.transport.hivemind.events import EventLog
from swarm.transport.hivemind.handoff import Handoff
from swarm.transport.hivemind.loop import LoopThread
from swarm.transport.hivemind.meta import address
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.ordering import Numbering
from swarm.transport.hivemind.pacing import FlowPacer
from swarm.transport.hivemind.retry import Retry
from swarm.transport.hivemind.routing import NoPeerError, Router
from swarm.transport.hivemind.trainer.accounts import Accounts
from swarm.transport.hivemind.trainer.adaptive import AdaptiveCodecs
from swarm.transport.hivemind.trainer.recovery import Recovery
from swarm.transport.hivemind.trainer.rounds import SwarmRounds, codec_changes
from swarm.transport.hivemind.trust.owner import Owner

log = logging.getLogger(__name__)


class SwarmPipeline:
    def __init__(
        self,
        node: SwarmNode,
        loop: LoopThread,
        cfg: ExperimentConfig,
        run_id: str,
        in_flight: int | None = None,
        snapshot_every: int = 0,
        fresh: bool = False,
        owner_key: RSAPrivateKey | None = None,
        allow=(),
        private: bool = False,
    ) -> None:
        self.node, self.loop, self.cfg, self.run_id = node, loop, cfg, run_id
        self.num_stages = cfg.model.num_stages
        self.in_flight = micro_batches_in_flight(in_flight or cfg.train.in_flight, self.num_stages, node.settings)
        # the run's owner: signs control calls, admits members (swarm.transport.hivemind.trust)
        self.owner = Owner(owner_key or RSAPrivateKey.process_wide(), run_id, allow, private)
        self.session = uuid.uuid4().hex
        self.router = Router(node, run_id, lambda r: self.owner.routable(r, self.session), self.owner.allows)
        self.events = EventLog()  # joins, leaves, bans, pauses: its progress record and metrics show them
        self.router.events = self.events
        self.state = "starting"  # training, paused: why, finished (its progress record)
        self.in_swarm = Busy()  # seconds the training loop waited on the swarm (micro-batches, rounds)
        self.members: dict[int, list[str]] = {}  # stage -> peers set up for this run
        self.following: set[str] = set()  # members that joined mid-run and are still catching up
        self._dropped: dict[str, float] = {}  # peer -> DHT time it was left out (older records of it are stale)
        self._setup_args: tuple[int, int] = (0, 0)  # (lr horizon, capacity) every setup carries
        self.tied: list[TiedPair] = []
        self.step_index = 0  # optimizer steps done
        self.routes: dict[int, list[str]] = {}  # this step's finished micro-batches: index -> peer per stage
        # ... and what they were, to re-run if a peer leaves
        self._sent: dict[int, tuple[MicroBatch, torch.Tensor]] = {}
        self.numbering = Numbering()  # of our messages to each stage-0 peer
        self.pacer = FlowPacer(node.uplink_bits, None, flows=1)  # inputs to stage 0, with a declared --uplink
        sending = Sending(node.settings.sending_per_neighbour)
        admission = lambda: self.owner.admit(self.session, node.peer_id, trainer=True)  # noqa: E731
        self.handoff = Handoff(
            node, self.router, run_id, 0, self.pacer, sending, self.numbering.restart, admission=admission
        )
        self.retry = Retry(node.settings)
        self.rounds = SwarmRounds(self)
        self.recovery = Recovery(self, snapshot_every)  # the swarm's copies of every stage, every few steps
        self.fresh = fresh  # start at step 0 even where the swarm kept copies of an earlier trainer's run
        self._resumed: dict | None = None  # the position of a run taken over from an earlier trainer
        self.adaptive = AdaptiveCodecs(cfg) if cfg.compression.adaptive is not None else None
        self.accounts = Accounts(self)  # the stage peers' statuses: link bytes, compute, state

    # ---- joining -----------------------------------------------------------------------------

    def setup(self, lr_horizon: int, capacity: int | None, wait_s: float | None = None) -> dict[int, list[str]]:
        """Waits (at most `wait_s`, default the settings' setup_wait_s) until every stage has a peer,
        then sets each up for this session; the peers per stage."""
        wait_s = self.node.settings.setup_wait_s if wait_s is None else wait_s
        return self.loop.run(self._setup(lr_horizon, capacity, wait_s))

    async def _setup(self, lr_horizon: int, capacity: int | None, wait_s: float) -> dict[int, list[str]]:
        deadline = time.monotonic() + wait_s
        while True:
            found = {s: await self.router.peers(s, refresh=True) for s in range(self.num_stages)}
            missing = [s for s, records in found.items() if not records]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise NoPeerError(
                    f"no peer serves stage(s) {', '.join(map(str, missing))} of run {self.run_id!r} after {wait_s:.0f}s (start them with python -m peers.stage --stage N --run_id {self.run_id})"
                )
            await asyncio.sleep(0.5)
        self._setup_args = (lr_horizon, capacity or 0)
        available = {s: [r.peer_id for r in records if not r.leaving] for s, records in found.items()}
        resume = None if self.fresh else await self.recovery.resume_point(available)

        async def one(stage: int, peer_id: str):
            return stage, peer_id, await self.set_up(stage, peer_id)

        replies = await asyncio.gather(
            *(one(s, r.peer_id) for s, records in found.items() for r in records if not r.leaving)
        )
        self.members = defaultdict(list)
        self.following.clear()
        for stage, peer_id, reply in replies:
            self.members[stage].append(peer_id)
            if reply.tied and not self.tied:
                self.tied = [
                    TiedPair((t.first_stage, t.first_name), (t.second_stage, t.second_name)) for t in reply.tied
                ]
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
        self.state = "training"
        return dict(self.members)

    async def set_up(self, stage: int, peer_id: str, sources: list[str] = ()) -> pb.SetupReply:
        lr_horizon, capacity = self._setup_args
        request = pb.SetupRequest(
            to=address(self.run_id, stage),
            config_digest=config_digest(self.cfg),
            lr_horizon=lr_horizon,
            capacity=capacity,
            session=self.session,
            sources=sources,
            admission=self.owner.admit(self.session, peer_id, stage),
        )
        timeout = self.node.settings.call_timeout_s  # setups are idempotent (one session builds once)
        frame = await self.retry.same_peer(
            lambda: call(self.node.streams, peer_id, "setup", request, b"", timeout, self.owner.key),
            f"setup of stage {stage} peer {peer_id[-8:]}",
        )
        return frame.head

    def serving(self, stage: int) -> list[str]:
        """The stage's members in service (not still catching up)."""
        return [peer for peer in self.members.get(stage, []) if peer not in self.following]

    async def admit(self) -> list[tuple[int, str]]:
        """At a step boundary: sets up the peers that announced themselves for a stage with a peer in
        service since the last look (the router's cached view), as joiners; those admitted."""
        admitted = []
        for stage in range(self.num_stages):
            sources = self.serving(stage)
            if not sources:
                continue
            for peer in await self.candidates(stage, refresh=False):
                try:
                    await self.set_up(stage, peer, sources)
                except (TransportError, RemoteError) as e:
                    self.router.failed(peer)
                    log.warning("stage %d peer %s could not join: %s", stage, peer[-8:], one_line(e))
                    continue
                self.members[stage].append(peer)
                self.following.add(peer)
                admitted.append((stage, peer))
                self.events.add("join", f"stage {stage}: peer {peer[-8:]} joins at step {self.step_index}", logger=log)
        return admitted

    async def candidates(self, stage: int, refresh: bool = True, ours: bool = False) -> list[str]:
        """Peers that announced themselves for `stage` and are not in the run (nor left it since);
        with `ours`, also those left out that still run this session (a restore sets them up again)."""
        found = []
        for record in await self.router.peers(stage, refresh=refresh):
            peer = record.peer_id
            if peer in self.members.get(stage, []) or record.leaving or (record.session == self.session and not ours):
                continue
            if self.router.bans.banned(peer) or record.updated <= self._dropped.get(peer, float("-inf")):
                continue
            found.append(peer)
        return found

    def drop(self, stage: int, peer: str, why: str, left: bool = False) -> None:
        """`peer` is out of the run: it failed a round, or it `left` (drained, as it said it would)."""
        if peer in self.members.get(stage, []):
            self.members[stage].remove(peer)
        self.following.discard(peer)
        self._dropped[peer] = get_dht_time()
        level = logging.INFO if left else logging.WARNING
        self.events.add("leave", f"stage {stage}: peer {peer[-8:]} left the run ({why})", level, log)

    # ---- micro-batches -----------------------------------------------------------------------

    def run_many(self, items) -> list[dict[str, float]]:
        """Metrics of each (micro-batch, inputs), `in_flight` of them in the pipeline at a time."""
        items = list(items)
        return self._mended(lambda: self.loop.run(self._run_many(items)))

    def _mended(self, work):
        """`work()`; if it failed because a stage lost its last peer, the run pauses, every stage goes
        back to the swarm's copies (swarm.transport.hivemind.trainer.recovery) and the loop hears
        where from (`Rewound`)."""
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
        await self._run_many([self._sent[i] for i in indices])

    async def _run_many(self, items: list[tuple[MicroBatch, torch.Tensor]]) -> list[dict[str, float]]:
        self.accounts.step_statuses = None
        window, order = asyncio.Semaphore(self.in_flight), asyncio.Lock()

        async def one(batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
            async with window:  # both locks are fair: micro-batches leave in the order given
                return await self._one(batch, inputs, order)

        results = await asyncio.gather(*(one(b, x) for b, x in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _one(self, batch: MicroBatch, inputs: torch.Tensor, order: asyncio.Lock) -> dict[str, float]:
        async with order:  # numbers are taken in the order the micro-batches were given
            record = await self.handoff.choose(self.session)
            sent = self.numbering.take(record.peer_id)

        async def again(peer: str) -> tuple[tuple[int, int], bytes]:
            return self.numbering.take(peer), b""  # raw inputs, carried: valid on any link

        proof = self.owner.step_proof(self.session, batch.step)
        frame, _, _ = await self.handoff.send(batch, record, sent, b"", self.session, again, proof=proof, inputs=inputs)
        result = frame.head
        if result.kind != pb.DONE:
            raise RuntimeError(f"stage 0 finished micro-batch {batch.key} with kind {result.kind}, expected DONE")
        if len(result.route) != self.num_stages:
            raise RuntimeError(
                f"micro-batch {batch.key} came back through {len(result.route)} stages, expected {self.num_stages}"
            )
        if batch.mode is Mode.TRAIN:
            self.routes[batch.index] = list(result.route)
            self._sent[batch.index] = (batch, inputs)
            for stage, peer_id in enumerate(result.route):
                self.following.discard(peer_id)  # it served a micro-batch: it is in service
                if peer_id not in self.members.setdefault(stage, []) and self.owner.issued(
                    self.session, peer_id, stage
                ):
                    self.members[stage].append(peer_id)  # (a stage's word alone makes no one a member)
        return dict(result.metrics)

    # ---- the synchronous step ----------------------------------------------------------------

    def step(self) -> float:
        return self._mended(lambda: synchronous_step(self.rounds, self.tied, self.cfg.optimizer.grad_clip))

    def snapshot(self, step: int, position: dict) -> None:
        self._mended(lambda: self.loop.run(self.recovery.snapshot(step, position)))

    def resumed(self) -> dict | None:
        return self._resumed

    def finish(self) -> None:
        """The run is done: the copies the swarm kept of it go."""
        self.state = "finished"
        self.loop.run(self.recovery.discard())

    def went_back(self, step: int) -> None:
        """Every stage was restored to `step` (a checkpoint or the swarm's copies): every link
        restarts (new epochs) and this step starts over."""
        self.step_index = step
        self.following.clear()
        self.numbering.clear()
        self.routes.clear()
        self._sent.clear()

    def step_done(self) -> None:
        self.step_index += 1
        self.routes.clear()
        self._sent.clear()
        self.loop.run(self.admit())

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
        if self.adaptive is None:
            return notes
        decisions = {str(b): d.describe() for b, d in sorted(self.adaptive.last.items())}
        adaptive = {"changes": self.adaptive.history, "codecs": self.adaptive.ran, "decisions": decisions}
        return {**notes, "adaptive": adaptive}

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
        self._mended(lambda: self.loop.run(self.rounds.save(Path(directory), step)))

    def load_checkpoint(self, directory) -> int:
        step, saved = self.loop.run(self.rounds.load(Path(directory)))
        if saved is not None:
            self.adaptive.restore(saved)
        self.went_back(step)
        return step


def micro_batches_in_flight(asked: int | None, num_stages: int, settings) -> int:
    """Micro-batches in the pipeline at once: `asked`, or two per stage; never more than a stage
    peer takes from one sender at once (it refuses the rest)."""
    limit = settings.max_requests_per_sender
    if asked is not None and asked > limit:
        raise ValueError(
            f"train.in_flight={asked}: a stage peer takes at most {limit} micro-batches of one sender at once (max_requests_per_sender)"
        )
    return asked or min(2 * num_stages, limit)
