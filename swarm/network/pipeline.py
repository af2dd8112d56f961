"""`SwarmPipeline`: the trainer's side of the swarm, shaped like `LocalPipeline` so that
`swarm.run.train` drives stage peers over hivemind unchanged.

The trainer owns data and schedule: it sends each micro-batch to a stage-0 peer (which chains it
through the stages and back) and, after the last micro-batch of a step, runs the synchronous step
across every stage peer as `LocalPipeline.step` does in one process: tied-gradient sum between the
first and last stage, global gradient-norm clipping (tied parameters counted once), then every
stage's optimizer. Micro-batches run one at a time, in index order, as in `LocalPipeline`, so
order-dependent error-feedback state evolves exactly as in the single-process run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, defaultdict

import torch

from protocols import stage_pb2 as pb
from swarm.config import ExperimentConfig
from swarm.engine.microbatch import MicroBatch
from swarm.models import TiedPair
from swarm.network import PROTOCOL_VERSION
from swarm.network.calls import MicroBatchCall, TransportError, call_info, call_setup, call_step
from swarm.network.hosted import config_digest
from swarm.network.meta import batch_to_meta, payload_to_tensors, tensor_to_raw, tensors_to_payload
from swarm.network.node import SwarmNode
from swarm.network.routing import NoPeerError, Router

log = logging.getLogger(__name__)


class SwarmPipeline:
    def __init__(self, node: SwarmNode, loop, cfg: ExperimentConfig, run_id: str, timeout: float = 120.0, attempts: int = 3) -> None:
        self.node, self.loop, self.cfg, self.run_id = node, loop, cfg, run_id
        self.num_stages = cfg.model.num_stages
        self.timeout, self.attempts = timeout, attempts
        self.router = Router(node, run_id)
        self.members: dict[int, list[str]] = {}  # stage -> peers set up for this run
        self.tied: list[TiedPair] = []
        self.grad_clip = cfg.optimizer.grad_clip
        self._entry: str | None = None
        self._step = 0

    # ---- joining -----------------------------------------------------------------------------

    def setup(self, lr_horizon: int, capacity: int | None, wait_s: float = 60.0) -> dict[int, list[str]]:
        return self.loop.run(self._setup(lr_horizon, capacity, wait_s))

    async def _setup(self, lr_horizon: int, capacity: int | None, wait_s: float) -> dict[int, list[str]]:
        """Waits until every stage has a peer, then sets each up for this run."""
        deadline = time.monotonic() + wait_s
        while True:
            found = {s: await self.router.peers(s, refresh=True) for s in range(self.num_stages)}
            missing = [s for s, records in found.items() if not records]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise NoPeerError(f"no peer serves stage(s) {', '.join(map(str, missing))} of run {self.run_id!r} after {wait_s:.0f}s (start them with python -m peers.stage --stage N --run_id {self.run_id})")
            await asyncio.sleep(0.5)
        request = dict(protocol_version=PROTOCOL_VERSION, run_id=self.run_id, config_digest=config_digest(self.cfg), lr_horizon=lr_horizon, capacity=capacity or 0)

        async def one(stage: int, peer_id: str):
            return stage, peer_id, await call_setup(self.node.p2p, peer_id, pb.SetupRequest(stage=stage, **request), self.timeout)

        replies = await asyncio.gather(*(one(s, r.peer_id) for s, records in found.items() for r in records))
        self.members = defaultdict(list)
        for stage, peer_id, reply in replies:
            self.members[stage].append(peer_id)
            if reply.tied and not self.tied:
                self.tied = [TiedPair((t.first_stage, t.first_name), (t.second_stage, t.second_name)) for t in reply.tied]
        return dict(self.members)

    # ---- micro-batches -----------------------------------------------------------------------

    def run(self, batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
        return self.loop.run(self._run(batch, inputs))

    async def _run(self, batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
        payload = tensor_to_raw(inputs).SerializeToString()
        tried: set[str] = set()
        entry = await self.router.choose(0, sticky=self._entry)
        for attempt in range(self.attempts):
            tried.add(entry.peer_id)
            head = pb.MicroBatchHead(protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=0, sender=self.node.peer_id, kind=pb.FORWARD, batch=batch_to_meta(batch), budget_s=self.timeout)
            call = MicroBatchCall(self.node.p2p, entry.peer_id, head, payload)
            try:
                result, _ = await call.reply(self.timeout + 5.0)
            except TransportError as e:
                self.router.failed(entry.peer_id)
                self._entry = None
                if attempt + 1 == self.attempts:
                    raise
                try:
                    entry = await self.router.choose(0, exclude=tried)
                except NoPeerError:
                    raise e from None
                log.warning("stage 0 peer failed (%s); retrying micro-batch %s on %s", e, batch.key, entry.peer_id[-8:])
                continue
            await call.confirm()
            self.router.succeeded(entry.peer_id)
            self._entry = entry.peer_id
            if result.kind != pb.DONE:
                raise RuntimeError(f"stage 0 finished micro-batch {batch.key} with kind {result.kind}, expected DONE")
            for stage, peer_id in enumerate(result.route):  # a peer that joined after setup still steps
                if peer_id not in self.members.setdefault(stage, []):
                    self.members[stage].append(peer_id)
            return dict(result.metrics)
        raise RuntimeError("unreachable")

    # ---- the synchronous step ----------------------------------------------------------------

    async def _round(self, stage: int, peer_id: str, payload: bytes = b"", **fields) -> tuple[pb.StepResult, bytes]:
        """One step round; rounds are idempotent on the peer, so a lost reply is simply retried."""
        head = pb.StepHead(protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=stage, step=self._step, **fields)
        for attempt in range(self.attempts):
            try:
                return await call_step(self.node.p2p, peer_id, head, payload, self.timeout)
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

    async def _step_all(self) -> float:
        """Tie, clip and step every stage peer, in `LocalPipeline.step`'s order of operations."""
        peers = self._peers()
        set_grads: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        tied_squares: list[float] = []
        for pair in self.tied:
            grads = []
            for stage, name in (pair.first, pair.second):
                peer = self.members.get(stage, [None])[0]
                if peer is None:
                    raise NoPeerError(f"no peer of stage {stage} holds tied parameter {name!r}")
                result, data = await self._round(stage, peer, get_grads=[name])
                grads.append(payload_to_tensors(result.grads, data).get(name))
            first, second = grads
            if first is None and second is None:
                continue
            total = (first if first is not None else torch.zeros_like(second)) + (second if second is not None else torch.zeros_like(first))
            set_grads[pair.first[0]][pair.first[1]] = total
            set_grads[pair.second[0]][pair.second[1]] = total
            tied_squares.append(float(total.detach().float().pow(2).sum()))
        norms: list[float] = []
        if set_grads or self.grad_clip is not None:
            for stage, peer in peers:
                slots, data = tensors_to_payload(set_grads.get(stage, {}))
                result = await self._round_or_drop(stage, peer, data, set_grads=slots, want_norm=self.grad_clip is not None)
                if result is not None:
                    norms.append(result[0].grad_sq_norm)
        scale = 0.0
        if self.grad_clip is not None:
            squares = sum(norms)
            for square in tied_squares:  # a tied parameter counts once, as in the unsplit model
                squares -= square
            norm = math.sqrt(max(squares, 0.0))
            if norm > self.grad_clip:
                scale = self.grad_clip / (norm + 1e-6)
        lrs = []
        for stage, peer in self._peers():
            result = await self._round_or_drop(stage, peer, scale=scale, apply=True)
            if result is not None:
                lrs.append(result[0].lr)
        self._step += 1
        return lrs[0]

    async def _round_or_drop(self, stage: int, peer_id: str, payload: bytes = b"", **fields):
        """A round on a peer that may have left: it is dropped from the run unless its stage has no other peer."""
        try:
            return await self._round(stage, peer_id, payload, **fields)
        except TransportError as e:
            if len(self.members.get(stage, [])) <= 1:
                raise
            self.members[stage].remove(peer_id)
            self.router.failed(peer_id)
            log.warning("stage %d peer %s left the run (%s); continuing with %d peer(s)", stage, peer_id[-8:], e, len(self.members[stage]))
            return None

    # ---- accounting --------------------------------------------------------------------------

    def statuses(self) -> list[pb.StageStatus]:
        return self.loop.run(self._statuses())

    async def _statuses(self) -> list[pb.StageStatus]:
        replies = await asyncio.gather(*(call_info(self.node.p2p, peer, self.run_id, self.timeout) for _, peer in self._peers()), return_exceptions=True)
        return [status for reply in replies if not isinstance(reply, BaseException) for status in reply.stages]  # a peer that left counts no more

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent per boundary, direction and mode, summed over peers (as LocalPipeline counts)."""
        totals: Counter = Counter()
        for status in self.statuses():
            for link in status.links:
                for key, n in link.sent.items():
                    direction, mode = key.split(".", 1)
                    totals[f"boundary{link.boundary}.{direction}.{mode}"] += n
        return dict(sorted(totals.items()))

    def state_bytes(self) -> int:
        return sum(status.state_bytes for status in self.statuses())

    def save_checkpoint(self, directory, step: int) -> None:
        raise NotImplementedError("checkpoints of a swarm run are not supported yet (use python -m swarm run --checkpoint_dir)")

    def load_checkpoint(self, directory) -> int:
        raise NotImplementedError("resuming a swarm run from a checkpoint is not supported yet (use python -m swarm run --checkpoint_dir)")
