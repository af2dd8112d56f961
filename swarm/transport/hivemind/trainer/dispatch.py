"""The trainer's micro-batches into the pipeline: `in_flight` at a time, numbered on each link to a
stage-0 peer in the order given (every stage processes them in that order), each carried through
the stages and back by stage 0 (swarm.transport.hivemind.stage.chain). A training micro-batch's heads
say how the step closes (swarm.transport.hivemind.trainer.closing), and every micro-batch brings the
owner's decision closing the step before, where one is pending."""

from __future__ import annotations

import asyncio
import time

import torch

from protocols import stage_pb2 as pb
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.tracing import TRACER
from swarm.transport.hivemind.flow.ordering import Numbering
from swarm.transport.hivemind.routing.handoff import Handoff
from swarm.transport.hivemind.trainer.closing import StepClosing
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace


class Dispatch:
    def __init__(
        self,
        place: TrainerPlace,
        membership: Membership,
        position: Position,
        handoff: Handoff,
        numbering: Numbering,
        closing: StepClosing,
        in_flight: int,
    ) -> None:
        self.place, self.membership, self.position = place, membership, position
        self.handoff, self.numbering, self.closing, self.in_flight = handoff, numbering, closing, in_flight

    async def run_many(self, items: list[tuple[MicroBatch, torch.Tensor]], again: bool = False) -> list[dict]:
        """Metrics of each (micro-batch, inputs); `again`: micro-batches of this step run once more."""
        window, order = asyncio.Semaphore(self.in_flight), asyncio.Lock()
        closing = 0
        if again:
            self.closing.rerun()
        elif items and items[0][0].mode is Mode.TRAIN:  # a step's micro-batches, all of them
            closing = self.closing.plan(items[0][0].step, len(items), self.handoff.retries)

        async def one(batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
            waited = time.time()
            async with window:  # both locks are fair: micro-batches leave in the order given
                TRACER.add("wait: in flight", "wait", waited, time.time(), mb=batch.label)
                return await self._one(batch, inputs, order, closing)

        results = await asyncio.gather(*(one(b, x) for b, x in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _one(
        self, batch: MicroBatch, inputs: torch.Tensor, order: asyncio.Lock, closing: int
    ) -> dict[str, float]:
        place, handoff = self.place, self.handoff
        async with order:  # numbers are taken in the order the micro-batches were given
            record = await handoff.choose(place.session)
            sent = self.numbering.take(record.peer_id)

        async def again(peer: str) -> tuple[tuple[int, int], bytes]:
            return self.numbering.take(peer), b""  # raw inputs, carried: valid on any link

        proof = place.owner.step_proof(place.session, batch.step)
        decision = self.closing.decision_for(batch.step)
        frame, _, _ = await handoff.send(
            batch,
            record,
            sent,
            b"",
            place.session,
            again,
            proof=proof,
            inputs=inputs,
            closing=closing,
            decision=decision,
        )
        result = frame.head
        if result.kind != pb.DONE:
            raise RuntimeError(f"stage 0 finished micro-batch {batch.key} with kind {result.kind}, expected DONE")
        if len(result.route) != place.num_stages:
            raise RuntimeError(
                f"micro-batch {batch.key} came back through {len(result.route)} stages, expected {place.num_stages}"
            )
        metrics = self.closing.heard(batch.step, dict(result.metrics), decision)
        if batch.mode is Mode.TRAIN:
            self.position.finished(batch, inputs, result.route)
            for stage, peer_id in enumerate(result.route):
                self.membership.served(peer_id)  # it served a micro-batch: it is in service
                if peer_id not in self.membership.members.get(stage, []) and place.owner.issued(
                    place.session, peer_id, stage
                ):
                    self.membership.add(stage, peer_id)  # (a stage's word alone makes no one a member)
        return metrics
