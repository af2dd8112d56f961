"""The trainer's micro-batches into the pipeline: `in_flight` at a time, numbered on each link to a
stage-0 peer in the order given (every stage processes them in that order), each carried through
the stages and back by stage 0 (swarm.transport.hivemind.stage.chain). A training micro-batch's heads
say how the step closes (swarm.transport.hivemind.trainer.closing), and every micro-batch brings the
owner's decision closing the step before, where one is pending.

With an asynchronous schedule the loop hands over the next step's micro-batches with a step's
(`following`): they queue behind the step's in the same window and order, so they enter the
pipeline while the step's are still in flight (the pipeline no longer drains at every step), and
the next `run_many` of them waits for what was started."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import Counter
from dataclasses import dataclass

import torch

from protocols import stage_pb2 as pb
from protocols.wire_names import DIGEST
from swarm.config import ExperimentConfig
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.tracing import TRACER
from swarm.transport.hivemind.flow.ordering import Numbering
from swarm.transport.hivemind.routing.handoff import Handoff, Terms
from swarm.transport.hivemind.trainer.closing import StepClosing
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace
from swarm.transport.hivemind.trainer.verdict import Accounted, RunAccounts
from swarm.transport.hivemind.trainer.verify import Verification
from swarm.transport.hivemind.trust.check_tokens import avoid_tokens


@dataclass(frozen=True)
class Entry:
    """The way into the pipeline: the handoff to a stage-0 peer and the numbering of each link to one."""

    handoff: Handoff
    numbering: Numbering


class Dispatch:
    def __init__(
        self,
        place: TrainerPlace,
        membership: Membership,
        position: Position,
        entry: Entry,
        closing: StepClosing,
        in_flight: int,
        cfg: ExperimentConfig,
    ) -> None:
        self.place, self.membership, self.position = place, membership, position
        self.handoff, self.numbering, self.closing, self.in_flight = entry.handoff, entry.numbering, closing, in_flight
        self.window: asyncio.Semaphore | None = None  # micro-batches in flight, of every call
        self.order: asyncio.Lock | None = None  # numbers taken in the order given, across calls
        self.ahead: tuple[list[tuple], asyncio.Task] | None = None  # the next step's, started early: keys, task
        self.out: Counter = Counter()  # step -> its training micro-batches sent and not back yet
        self.overlapped: set[int] = set()  # steps of which a micro-batch went out while the step before's were out
        self.verification = None  # train.verify: a fraction of micro-batches run again elsewhere and compared
        # step -> set once its checks are done: an asynchronous schedule's next step enters after them
        self.checking: dict[int, asyncio.Event] = {}
        if cfg.train.verify:
            self.verification = Verification(place, membership, position, cfg, self._verify_one, self._run_again)

    async def run_many(
        self, items: list[tuple[MicroBatch, torch.Tensor]], again: bool = False, following=()
    ) -> list[dict]:
        """Metrics of each (micro-batch, inputs); `again`: micro-batches of this step run once more;
        `following`: the next step's, started behind these (an asynchronous schedule)."""
        if self.window is None:  # made in the event loop's thread
            self.window, self.order = asyncio.Semaphore(self.in_flight), asyncio.Lock()
        ahead, self.ahead = self.ahead, None
        keys = [batch.key for batch, _ in items]
        if ahead is not None and ahead[0] != keys:  # the loop's mistake: what was started is not wanted
            ahead[1].cancel()
            await asyncio.gather(ahead[1], return_exceptions=True)
            raise RuntimeError(f"micro-batches {ahead[0][:1]}... were started ahead, then {keys[:1]}... asked for")
        if ahead is not None:
            task = ahead[1]
        else:
            task = asyncio.ensure_future(self._run_many(items, again, self._checks(items, again)))
        if following:
            started = asyncio.ensure_future(self._run_many(following, picks=self._checks(following, False)))
            self.ahead = ([batch.key for batch, _ in following], started)
        try:
            return await task
        except BaseException:
            await self.abandon()  # nothing of the next step goes on without this one
            raise

    async def abandon(self) -> None:
        """What was started ahead goes (the run went back to an earlier step, or this one failed)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead[1].cancel()
            await asyncio.gather(ahead[1], return_exceptions=True)
        for checked in self.checking.values():  # nothing waits for them any more
            checked.set()
        self.checking.clear()

    def _checks(self, items: list[tuple[MicroBatch, torch.Tensor]], again: bool) -> frozenset[int]:
        """train.verify: which of a step's micro-batches are checked, drawn as the step is handed over
        (the members see nothing of it), so that the next step knows whether to wait for the checks:
        a check may leave a peer out, and an asynchronous schedule's next step must not have run
        anything on it by then (its work would stay in that step)."""
        if self.verification is None or again or not items or items[0][0].mode is not Mode.TRAIN:
            return frozenset()
        step = items[0][0].step
        self.checking = {s: e for s, e in self.checking.items() if s >= step - 1}
        picks = self.verification.draw(items)
        if picks or self.verification.on_probation():
            self.checking[step] = asyncio.Event()
        return picks

    async def _run_many(
        self, items: list[tuple[MicroBatch, torch.Tensor]], again: bool = False, picks: frozenset[int] = frozenset()
    ) -> list[dict]:
        window, order = self.window, self.order
        closing = 0
        step = not again and bool(items) and items[0][0].mode is Mode.TRAIN  # a step's micro-batches, all of them
        if step and (before := self.checking.get(items[0][0].step - 1)) is not None:
            await before.wait()  # the step before's checks first: a peer they leave out runs none of this step
        if again:
            self.closing.rerun()
        elif step:
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
        metrics = [result for result, _ in results]
        if step and self.verification is not None:  # some of them are checked
            while self.position.step_index < items[0][0].step:  # started early: the step before closes first
                await asyncio.sleep(0.005)  # (the checks read this step's routes, kept from then on)
            redone = await self.verification.check(items, metrics, picks)
            metrics = [redone.get(batch.index, result) for (batch, _), result in zip(items, metrics, strict=True)]
        if step and (checked := self.checking.pop(items[0][0].step, None)):
            checked.set()  # (a failure leaves it unset: `abandon` then cancels what waits for it)
        return [{k: v for k, v in result.items() if not k.startswith(DIGEST)} for result in metrics]

    def notes(self) -> dict:
        """The summary row's account of verification (train.verify): checks made, and how many
        differed; of an asynchronous schedule's steps started while the step before was in flight."""
        notes = {"overlapped_steps": len(self.overlapped)} if self.overlapped else {}
        if self.verification is None:
            return notes
        return {**notes, "verified": {"checks": self.verification.checks, "mismatches": self.verification.mismatches}}

    async def _verify_one(self, item, avoid: tuple[int, list[str]]) -> tuple[dict, list[str]]:
        """A micro-batch once more, through none of `avoid` (stage, peers): its metrics and route."""
        self.closing.rerun()  # peers that ran it twice hold the second run's gradients: the rounds count
        return await self._one(*item, asyncio.Lock(), 0, avoid)

    def _avoid_tokens(self, batch: MicroBatch, avoid: tuple[int, list[str]] | None) -> list[bytes]:
        """train.verify: tokens that tell the peers of the stage before the checked one which peers
        to avoid (none for stage 0's: we choose those); every training micro-batch has some."""
        if self.verification is None:
            return []
        stage, peers = avoid if avoid else (0, [])
        place = self.place
        keys = [place.owner.check_keys.of(place.session, q) for q in self.membership.members.get(stage - 1, [])]
        return avoid_tokens(keys if stage else [], batch.attempt, peers)

    async def _run_again(self, items) -> list[dict]:
        return await self._run_many(items, again=True)

    async def _one(
        self, batch: MicroBatch, inputs: torch.Tensor, order: asyncio.Lock, closing: int, avoid=None
    ) -> tuple[dict[str, float], list[str]]:
        """Its metrics and route; `avoid`: (stage, peers) it must not go through (a verification's
        second run: its gradients are not the step's)."""
        place, handoff = self.place, self.handoff
        if batch.mode is Mode.TRAIN:  # a new attempt: only its gradients count (stage.attempts)
            batch = dataclasses.replace(batch, attempt=os.urandom(8))
            self.position.issue(batch)
        async with order:  # numbers are taken in the order the micro-batches were given
            await self.closing.ready(batch.step)  # dc: the decision it brings may wait for norms still coming
            record = await handoff.choose(place.session, avoid[1] if avoid and avoid[0] == 0 else ())
            sent = self.numbering.take(record.peer_id)

        async def again(peer: str) -> tuple[tuple[int, int], bytes]:
            return self.numbering.take(peer), b""  # raw inputs, carried: valid on any link

        decision = self.closing.decision_for(batch.step)
        carry = pb.MicroBatchHead(
            step_proof=place.owner.step_proof(place.session, batch.step),
            roster=self.membership.roster(),
            closing=closing,
            avoid_tokens=self._avoid_tokens(batch, avoid) if batch.mode is Mode.TRAIN else [],
        )
        if decision is not None and decision.ByteSize():
            carry.decision.CopyFrom(decision)
        training = batch.mode is Mode.TRAIN
        if training and self.out[batch.step - 1]:
            self.overlapped.add(batch.step)
        self.out[batch.step] += training
        try:
            terms = Terms(place.session, carry=carry, avoid=frozenset(avoid[1] if avoid and avoid[0] == 0 else ()))
            frame, first_peer, _ = await handoff.send(batch, record, sent, b"", again, terms, inputs)
        finally:
            self.out[batch.step] -= training
            if not self.out[batch.step]:
                del self.out[batch.step]
        result = frame.head
        if result.kind != pb.DONE:
            raise RuntimeError(f"stage 0 finished micro-batch {batch.key} with kind {result.kind}, expected DONE")
        if len(result.route) != place.num_stages:
            raise RuntimeError(
                f"micro-batch {batch.key} came back through {len(result.route)} stages, expected {place.num_stages}"
            )
        metrics = self.closing.heard(batch.step, dict(result.metrics), decision)
        if training and self.verification is not None:  # what the stages' accounts say of this run
            metrics = Accounted(metrics)
            metrics.accounts, metrics.attempt = RunAccounts(first_peer, tuple(result.evidence)), batch.attempt
        if batch.mode is Mode.TRAIN:
            self.position.finished(batch, inputs, result.route, avoid is None, result.exponents)
            for peer_id in result.route:
                self.membership.served(peer_id)  # it served a micro-batch: it is in service
        return metrics, list(result.route)


def micro_batches_in_flight(asked: int | None, num_stages: int, settings) -> int:
    """Micro-batches in the pipeline at once: `asked`, or two per stage; never more than a stage
    peer takes from one sender at once (it refuses the rest)."""
    limit = settings.limits.max_requests_per_sender
    if asked is not None and asked > limit:
        raise ValueError(
            f"train.in_flight={asked}: a stage peer takes at most {limit} micro-batches of one sender at once (max_requests_per_sender)"
        )
    return asked or min(2 * num_stages, limit)
