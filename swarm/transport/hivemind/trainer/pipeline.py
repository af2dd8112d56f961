"""`SwarmPipeline`: the trainer's side of the swarm, shaped like `LocalPipeline` so that
`swarm.training.loop.train` drives stage peers over hivemind unchanged.

The trainer owns data and schedule: it sends micro-batches to stage-0 peers (each chains its
micro-batch through the stages and back), several at once and numbered on each link so every
stage processes them in the trainer's order. After the last micro-batch of a step it runs the
synchronous step across every stage peer as `LocalPipeline.step` does in one process: each peer
adds up the gradients of the micro-batches that finished through it (its held gradients of
failed attempts never count), replicas of a stage are summed, tied gradients summed between the
first and last stage, gradients clipped by the global norm (tied parameters counted once), then
every stage's optimizer steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import torch

from protocols import stage_pb2 as pb
from swarm.config import ExperimentConfig
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.models import TiedPair
from swarm.transport.hivemind import PROTOCOL_VERSION
from swarm.transport.hivemind.calls import (
    MicroBatchCall,
    RemoteError,
    Sending,
    TransportError,
    call_info,
    call_setup,
    call_step,
)
from swarm.transport.hivemind.meta import batch_to_meta, payload_to_tensors, tensor_to_raw, tensors_to_payload
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.ordering import OutLink
from swarm.transport.hivemind.pacing import FlowPacer
from swarm.transport.hivemind.routing import NoPeerError, Router
from swarm.transport.hivemind.stage.host import config_digest
from swarm.transport.hivemind.trainer.adaptive import CHECKPOINT_FILE, AdaptiveCodecs, checkpoint_codecs

log = logging.getLogger(__name__)


class SwarmPipeline:
    def __init__(
        self,
        node: SwarmNode,
        loop,
        cfg: ExperimentConfig,
        run_id: str,
        timeout: float = 120.0,
        attempts: int = 3,
        in_flight: int | None = None,
    ) -> None:
        self.node, self.loop, self.cfg, self.run_id = node, loop, cfg, run_id
        self.num_stages = cfg.model.num_stages
        self.timeout, self.attempts = timeout, attempts
        self.in_flight = in_flight or cfg.train.in_flight or 2 * self.num_stages
        self.router = Router(node, run_id)
        self.session = uuid.uuid4().hex
        self.members: dict[int, list[str]] = {}  # stage -> peers set up for this run
        self.tied: list[TiedPair] = []
        self.grad_clip = cfg.optimizer.grad_clip
        self.links: dict[str, OutLink] = {}  # stage-0 peer -> our numbering of that link
        self._entry: str | None = None
        self._step = 0
        self._routes: dict[int, list[str]] = {}  # this step's finished micro-batches: index -> peer per stage
        self._sent: dict[int, tuple[MicroBatch, bytes]] = {}  # ... and what they were, to re-run if a peer leaves
        self.sending = Sending()
        self.pacer = FlowPacer(node.uplink_bits, None, flows=1)  # inputs to stage 0, with a declared --uplink
        self.adaptive = AdaptiveCodecs(cfg) if cfg.compression.adaptive is not None else None
        self._step_statuses: list[pb.StageStatus] | None = (
            None  # read by this step's adaptive decision, valid until more micro-batches run
        )
        self._counted: list[pb.StageStatus] | None = (
            None  # what link_bytes last read: its stages' compute goes in the step's row
        )

    # ---- joining -----------------------------------------------------------------------------

    def setup(self, lr_horizon: int, capacity: int | None, wait_s: float = 60.0) -> dict[int, list[str]]:
        return self.loop.run(self._setup(lr_horizon, capacity, wait_s))

    async def _setup(self, lr_horizon: int, capacity: int | None, wait_s: float) -> dict[int, list[str]]:
        """Waits until every stage has a peer, then sets each up for this session."""
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
        request = dict(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            config_digest=config_digest(self.cfg),
            lr_horizon=lr_horizon,
            capacity=capacity or 0,
            session=self.session,
        )

        async def one(stage: int, peer_id: str):
            return (
                stage,
                peer_id,
                await call_setup(self.node.p2p, peer_id, pb.SetupRequest(stage=stage, **request), self.timeout),
            )

        replies = await asyncio.gather(*(one(s, r.peer_id) for s, records in found.items() for r in records))
        self.members = defaultdict(list)
        for stage, peer_id, reply in replies:
            self.members[stage].append(peer_id)
            if reply.tied and not self.tied:
                self.tied = [
                    TiedPair((t.first_stage, t.first_name), (t.second_stage, t.second_name)) for t in reply.tied
                ]
        return dict(self.members)

    # ---- micro-batches -----------------------------------------------------------------------

    def run(self, batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
        return self.run_many([(batch, inputs)])[0]

    def run_many(self, items) -> list[dict[str, float]]:
        """Metrics of each (micro-batch, inputs), `in_flight` of them in the pipeline at a time."""
        return self.loop.run(self._run_many([(batch, tensor_to_raw(x).SerializeToString()) for batch, x in items]))

    async def _run_many(self, items: list[tuple[MicroBatch, bytes]]) -> list[dict[str, float]]:
        self._step_statuses = None
        window, order = asyncio.Semaphore(self.in_flight), asyncio.Lock()

        async def one(batch: MicroBatch, payload: bytes) -> dict[str, float]:
            async with window:  # both locks are fair: micro-batches leave in the order given
                return await self._one(batch, payload, order)

        results = await asyncio.gather(*(one(b, p) for b, p in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _one(self, batch: MicroBatch, payload: bytes, order: asyncio.Lock) -> dict[str, float]:
        async with order:  # numbers are taken in the order the micro-batches were given
            record = await self.router.choose(0, sticky=self._entry, session=self.session)
            entry = self._entry = record.peer_id
            sent = self.links.setdefault(entry, OutLink()).take()
        tried: set[str] = set()
        for attempt in range(self.attempts):
            tried.add(entry)
            head = pb.MicroBatchHead(
                protocol_version=PROTOCOL_VERSION,
                run_id=self.run_id,
                stage=0,
                sender=self.node.peer_id,
                kind=pb.FORWARD,
                batch=batch_to_meta(batch),
                budget_s=self.timeout,
                epoch=sent[0],
                seq=sent[1],
            )
            self.pacer.heard(entry, record.download_share, fallback=True)
            call = MicroBatchCall(self.node.streams, entry, head, payload, self.sending, self.pacer.flow(entry))
            try:
                result, _ = await call.reply(self.timeout + 5.0)
                self.pacer.heard(entry, result.share_bits)
                break
            except (TransportError, RemoteError) as e:
                self.links[entry].reset()
                if isinstance(e, RemoteError) and not e.retry_link or attempt + 1 == self.attempts:
                    raise
                if isinstance(e, TransportError):
                    self.router.failed(entry)
                    self._entry = None
                    try:
                        record = await self.router.choose(0, exclude=tried, session=self.session)
                        entry = record.peer_id
                    except NoPeerError:
                        raise e from None
                log.warning("micro-batch %s failed (%s); retrying on stage 0 peer %s", batch.key, e, entry[-8:])
                sent = self.links.setdefault(entry, OutLink()).take()
        call.finish()
        self.router.succeeded(entry)
        if result.kind != pb.DONE:
            raise RuntimeError(f"stage 0 finished micro-batch {batch.key} with kind {result.kind}, expected DONE")
        if len(result.route) != self.num_stages:
            raise RuntimeError(
                f"micro-batch {batch.key} came back through {len(result.route)} stages, expected {self.num_stages}"
            )
        if batch.mode is Mode.TRAIN:
            self._routes[batch.index] = list(result.route)
            self._sent[batch.index] = (batch, payload)
            for stage, peer_id in enumerate(result.route):
                if peer_id not in self.members.setdefault(stage, []):
                    self.members[stage].append(peer_id)
        return dict(result.metrics)

    # ---- the synchronous step ----------------------------------------------------------------

    async def _round(self, stage: int, peer_id: str, payload: bytes = b"", **fields) -> tuple[pb.StepResult, bytes]:
        """One step round; rounds are idempotent on the peer, so a lost reply is simply retried."""
        head = pb.StepHead(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=stage, step=self._step, **fields
        )
        for attempt in range(self.attempts):
            try:
                return await call_step(self.node.p2p, peer_id, head, payload, self.timeout, self.node.egress)
            except TransportError as e:
                if attempt + 1 == self.attempts:
                    raise
                log.warning("step round on stage %d peer %s failed (%s); retrying", stage, peer_id[-8:], e)
                await asyncio.sleep(0.2 * (attempt + 1))
        raise RuntimeError("unreachable")

    def _peers(self) -> list[tuple[int, str]]:
        return [(stage, peer) for stage in sorted(self.members) for peer in self.members[stage]]

    def step(self) -> float:
        return self.loop.run(self._step_all())

    async def _accumulate_on(self, stage: int, peer: str, indices: list[int], wanted: list[str]):
        replicated = len(self.members[stage]) > 1
        return await self._round(
            stage,
            peer,
            accumulate=True,
            micro_batches=sorted(indices),
            all_grads=replicated,
            get_grads=[] if replicated else wanted,
        )

    async def _accumulate(self) -> dict[int, dict[str, torch.Tensor]]:
        """First round: every peer sums the gradients of its finished micro-batches; returns, per
        stage, the gradients the trainer must combine (all of a replicated stage, tied ones).

        A peer that left with micro-batches of this step makes them run again elsewhere first."""
        wanted: dict[int, list[str]] = defaultdict(list)
        for pair in self.tied:
            for stage, name in (pair.first, pair.second):
                wanted[stage].append(name)
        for _ in range(self.attempts):
            counted: dict[tuple[int, str], list[int]] = defaultdict(list)
            for index, route in self._routes.items():
                for stage, peer in enumerate(route):
                    counted[(stage, peer)].append(index)
            peers = self._peers()
            replies = await asyncio.gather(
                *(self._accumulate_on(s, p, counted.get((s, p), []), wanted.get(s, [])) for s, p in peers),
                return_exceptions=True,
            )
            lost = [(s, p, r) for (s, p), r in zip(peers, replies, strict=True) if isinstance(r, TransportError)]
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, TransportError):
                    raise reply
            if not lost:
                break
            rerun = sorted({i for s, p, _ in lost for i in counted.get((s, p), [])})
            for stage, peer, error in lost:
                if len(self.members[stage]) <= 1:
                    raise error
                self.members[stage].remove(peer)
                self.router.failed(peer)
                log.warning(
                    "stage %d peer %s left the run (%s); re-running its micro-batches %s",
                    stage,
                    peer[-8:],
                    error,
                    rerun,
                )
            if rerun:
                await self._run_many([self._sent[i] for i in rerun])
        else:
            raise RuntimeError(f"step {self._step}: stage peers kept leaving while gathering gradients")
        combined: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        for (stage, _), (result, data) in zip(peers, replies, strict=True):
            for name, grad in payload_to_tensors(result.grads, data).items():
                total = combined[stage].get(name)
                combined[stage][name] = grad if total is None else total + grad
        return combined

    async def _step_all(self) -> float:
        """Accumulate, combine, clip and step every stage peer, in `LocalPipeline.step`'s order of operations."""
        combined = await self._accumulate()
        set_grads: dict[int, dict[str, torch.Tensor]] = {
            s: dict(g) for s, g in combined.items() if len(self.members[s]) > 1
        }
        tied_squares: list[float] = []
        for pair in self.tied:
            first, second = (combined.get(stage, {}).get(name) for stage, name in (pair.first, pair.second))
            if first is None and second is None:
                continue
            total = (first if first is not None else torch.zeros_like(second)) + (
                second if second is not None else torch.zeros_like(first)
            )
            for stage, name in (pair.first, pair.second):
                set_grads.setdefault(stage, {})[name] = total
            tied_squares.append(float(total.detach().float().pow(2).sum()))
        squares = 0.0
        if set_grads or self.grad_clip is not None:

            async def second(stage: int, peer: str):
                slots, data = tensors_to_payload(set_grads.get(stage, {}))
                want_norm = self.grad_clip is not None and peer == self.members[stage][0]  # replicas hold the same sum
                return await self._round(stage, peer, data, set_grads=slots, want_norm=want_norm)

            replies = await asyncio.gather(*(second(s, p) for s, p in self._peers()))
            squares = sum(result.grad_sq_norm for result, _ in replies)
        scale = 0.0
        if self.grad_clip is not None:
            for square in tied_squares:  # a tied parameter counts once, as in the unsplit model
                squares -= square
            norm = math.sqrt(max(squares, 0.0))
            if norm > self.grad_clip:
                scale = self.grad_clip / (norm + 1e-6)
        codecs = await self._adapt()
        replies = await asyncio.gather(
            *(self._round(s, p, scale=scale, apply=True, codecs=codecs) for s, p in self._peers())
        )
        self._step += 1
        self._routes.clear()
        self._sent.clear()
        return replies[0][0].lr

    async def _adapt(self) -> list[pb.BoundaryCodecs]:
        """compression.adaptive: the boundaries whose codecs change from the next step on (every
        peer of both stages of such a boundary switches in this step's apply round)."""
        if self.adaptive is None:
            return []
        self.adaptive.step_done()
        if not self.adaptive.due(self._step + 1):
            return []
        self._step_statuses = await self._statuses()  # after the last micro-batch: also this step's link bytes
        changes = self.adaptive.observe(self._step_statuses, self._step + 1)
        for boundary in changes:
            log.info("after step %d: adaptive compression, %s", self._step + 1, self.adaptive.last[boundary].describe())
        return [pb.BoundaryCodecs(boundary=b, forward=fw, backward=bw) for b, (fw, bw) in sorted(changes.items())]

    def step_notes(self) -> dict:
        """Extra fields of a step's results row: the codecs that step ran with (adaptive compression),
        and every stage peer's compute so far (with link_bytes' statuses), so that figures over some
        steps (bench throughput leaves the warm-up out) take the compute of the same steps."""
        notes = {"codecs": self.adaptive.ran} if self.adaptive is not None else {}
        if self._counted is not None:
            notes["stages"] = [_compute_row(status) for status in self._counted]
        return notes

    def summary_notes(self) -> dict:
        """The summary row's account of adaptive compression: every change, and the latest decisions."""
        if self.adaptive is None:
            return {}
        decisions = {str(b): d.describe() for b, d in sorted(self.adaptive.last.items())}
        return {"adaptive": {"changes": self.adaptive.history, "codecs": self.adaptive.ran, "decisions": decisions}}

    def adaptive_report(self) -> str | None:
        return self.adaptive.report() if self.adaptive is not None else None

    # ---- accounting --------------------------------------------------------------------------

    def statuses(self) -> list[pb.StageStatus]:
        return self.loop.run(self._statuses())

    async def _statuses(self) -> list[pb.StageStatus]:
        replies = await asyncio.gather(
            *(call_info(self.node.p2p, peer, self.run_id, self.timeout) for _, peer in self._peers()),
            return_exceptions=True,
        )
        return [
            status for reply in replies if not isinstance(reply, BaseException) for status in reply.stages
        ]  # a peer that left counts no more

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent per boundary, direction and mode, summed over peers (as LocalPipeline counts)."""
        totals: Counter = Counter()
        statuses, self._step_statuses = self._step_statuses, None
        self._counted = statuses if statuses is not None else self.statuses()
        for status in self._counted:
            for link in status.links:
                for key, n in link.sent.items():
                    direction, mode = key.split(".", 1)
                    totals[f"boundary{link.boundary}.{direction}.{mode}"] += n
        return dict(sorted(totals.items()))

    def stage_rows(self) -> list[dict]:
        """Per stage peer: training compute seconds and samples (a throughput benchmark's compute bound)."""
        return [{**_compute_row(s), "processed": s.processed, "throughput": s.throughput} for s in self.statuses()]

    def state_bytes(self) -> int:
        return sum(status.state_bytes for status in self.statuses())

    def save_checkpoint(self, directory, step: int) -> None:
        """`stage<i>.pt` per stage in `directory`, fetched from the stage's first peer (replicas
        hold the same weights): the single-process format, so either transport can resume it."""
        self.loop.run(self._save(Path(directory), step))

    async def _save(self, directory: Path, step: int) -> None:
        from swarm.engine.checkpoint import atomic_write

        async def one(stage: int):
            _, blob = await self._round(stage, self.members[stage][0], save=True)
            atomic_write(directory / f"stage{stage}.pt", lambda f: f.write(blob))

        await asyncio.gather(*(one(s) for s in range(self.num_stages)))
        if self.adaptive is not None:  # the links' saved state belongs to these codecs
            atomic_write(directory / CHECKPOINT_FILE, lambda f: f.write(self.adaptive.saved().encode()))

    def load_checkpoint(self, directory) -> int:
        """Installs every `stage<i>.pt` of `directory` on every peer of that stage; returns the step."""
        return self.loop.run(self._load(Path(directory)))

    async def _load(self, directory: Path) -> int:
        blobs = {}
        for stage in range(self.num_stages):
            path = directory / f"stage{stage}.pt"
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {directory} has no {path.name}")
            blobs[stage] = path.read_bytes()
        saved = checkpoint_codecs(directory, adaptive=self.adaptive is not None)
        codecs = (
            []
            if saved is None
            else [
                pb.BoundaryCodecs(boundary=b, forward=fw, backward=bw)
                for b, (fw, bw) in sorted(saved["codecs"].items())
            ]
        )
        replies = await asyncio.gather(
            *(self._round(s, p, blobs[s], load=True, codecs=codecs) for s, p in self._peers())
        )
        steps = {int(result.step) for result, _ in replies}
        if len(steps) != 1:
            raise ValueError(f"checkpoint {directory} mixes stages saved at steps {sorted(steps)}")
        self._step = steps.pop()
        if saved is not None:
            self.adaptive.restore(saved)
        self.links.clear()  # every link restarts (new epochs) from the loaded ends
        self._routes.clear()
        self._sent.clear()
        return self._step


def _compute_row(status: pb.StageStatus) -> dict:
    """A stage peer's training compute so far: seconds, its computing thread's CPU seconds, samples."""
    return {
        "stage": status.stage,
        "compute_s": status.compute_s,
        "compute_cpu_s": status.compute_cpu_s,
        "samples": status.samples,
    }
