"""The trainer's side of a step that closes on the way (swarm.transport.hivemind.stage.closing): which
steps may, the norms their micro-batches' replies bring, and the owner's decision the next step's
micro-batches carry.

A step closes on the way when every stage has one peer in service, no parameter is tied across
stages and the codecs are fixed (`plan`); else, or when its micro-batches were retried or run
again, or a stage's norm did not come back, it closes by the rounds (swarm.engine.step), with the
same floats. A decision no micro-batch has brought yet is applied by a round (`settle`) before
anything that needs every stage past the step: admitting a joiner (it downloads a stage's state), a
copy, a checkpoint, the run's end.

With an asynchronous schedule (swarm.engine.delay, `depth` 2) step t's decision comes with step
t + 2's micro-batches (it applies g_t, a step late) and step t + 1's may be out while step t's are.
A step that cannot close on the way closes by one round (`late_round`: every stage's norm of its held
gradients, nothing applied) and its decision still rides with step t + 2's micro-batches. A
checkpoint or copy of an asynchronous run holds the last step's gradients unapplied: after a
restore the decision of that step is made again the same way (`reopen`). With dc a
step's norms come a step late (`late`: trainer.late_norms); a dc step that cannot close on the way
first has the step before decided and applied everywhere (its norms are of gradients compensated
at the weights they apply to), then the same round; replicas compensate their whole sum
(stage.combine), with the weights the step ran at, which each keeps whether or not it ran any of
the step's micro-batches (swarm.engine.versions `serves`).

An asynchronous step over a stage with two or more peers closes by one round too, the held round's
summing form (trainer.replicas: replicas sum what they ran among themselves), and the same round
hands the decision of the step before to every peer that did not have it from a micro-batch (a
replica may get none of the micro-batches that bring it): a decision is applied on a peer by the
first of a micro-batch's head or a round, once. So does a step of a model with tied parameters:
the held round sums them across their two stages too. So does every step of a run with adaptive
codecs; their changes come after a step the pipeline drained at (the loop starts nothing of the
next step ahead where a decision is due), by the apply round of the step before (`switch`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from protocols import stage_pb2 as pb
from protocols.wire_names import LATE, LR, RERUN, SQUARE
from swarm.config.experiment import TrainConfig
from swarm.config.schedule import DelayCorrection
from swarm.engine.step import clip_scale
from swarm.transport.hivemind.trainer.late_norms import LateDecisions
from swarm.transport.hivemind.trainer.membership import Membership, TrainerPlace
from swarm.transport.hivemind.trainer.replicas import replicated, summed
from swarm.transport.hivemind.trainer.rounds import SwarmRounds


@dataclasses.dataclass
class _Open:
    """A step whose micro-batches are out, closing on the way."""

    retries: int  # the handoff's retries when its micro-batches went out
    squares: dict[int, float] = dataclasses.field(default_factory=dict)  # stage -> its squared gradient norm
    lr: float | None = None
    clean: bool = True  # no micro-batch of it retried or run again


class StepClosing:
    def __init__(
        self,
        place: TrainerPlace,
        membership: Membership,
        rounds: SwarmRounds,
        train: TrainConfig,
        fixed_codecs: bool,
        depth: int = 1,
    ) -> None:
        self.place, self.membership, self.rounds = place, membership, rounds
        self.micro_batches, self.fixed_codecs, self.depth = train.micro_batches, fixed_codecs, depth
        self.open: dict[int, _Open] = {}  # the steps closing on the way (`depth` at most)
        self.pending: dict[int, pb.StepDecision] = {}  # step -> its decision, until a micro-batch brought it
        self.last: int | None = None  # the last step closed on the way
        self.closed = 0  # steps closed on the way (the summary's count)
        correction = DelayCorrection.parse(train.delay_correction).kind if depth > 1 else "none"
        self.late = LateDecisions(place.num_stages, self._decide) if correction == "dc" else None  # a step late

    def alone(self) -> bool:
        """Every stage has one member, none still joining."""
        members = self.membership
        return not members.following and all(len(members.members.get(s, [])) == 1 for s in range(self.place.num_stages))

    def plan(self, step: int, count: int, retries: int) -> int:
        """How many micro-batches the step's heads say it has (0: it closes by the rounds; an
        asynchronous step by `late_round`)."""
        eligible = self.alone() and not self.place.tied and self.fixed_codecs
        self.open = {s: o for s, o in self.open.items() if step - self.depth < s < step}
        if not eligible or count != self.micro_batches:
            return 0
        self.open[step] = _Open(retries)
        return count

    def heard(self, step: int, metrics: dict[str, float], decision: pb.StepDecision | None) -> dict[str, float]:
        """A micro-batch of `step`, sent with `decision`, came back with these metrics: what they
        report of the step's closing is taken out (the rest is the loop's)."""
        if decision is not None and self.pending.get(decision.step) is decision and self.alone():
            del self.pending[decision.step]  # every stage applied it (a replica may get no micro-batch)
        ours = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith((SQUARE, LATE)) or k in (RERUN, LR)]}
        if self.late is not None:
            self.late.heard(step, ours)
        closing = self.open.get(step)
        if closing is None:
            return metrics
        if RERUN in ours:
            closing.clean = False
        for key, value in ours.items():
            if key.startswith(SQUARE):
                closing.squares[int(key.removeprefix(SQUARE))] = value
        closing.lr = ours.get(LR, closing.lr)
        return metrics

    def rerun(self) -> None:
        """Micro-batches of the step run again (a peer that ran them left): it closes by the rounds."""
        for closing in self.open.values():
            closing.clean = False

    def close(self, step: int, grad_clip: float | None, retries: int) -> float | None:
        """The learning rate of `step` closed on the way (its decision now pending for the
        micro-batches `depth` steps later; with dc, once its norms came: `late`), or None: it closes
        by the rounds (an asynchronous step by the one round of `late_round`)."""
        closing = self.open.pop(step, None)
        on_the_way = (
            closing is not None
            and closing.clean
            and retries == closing.retries
            and (self.late is not None or sorted(closing.squares) == list(range(self.place.num_stages)))
            and closing.lr is not None
        )
        if not on_the_way:
            return None
        if self.late is not None:  # decided when its norms come (on the loop, where they are heard)
            self.place.loop.run(self.late.closed(step, grad_clip))
        else:
            self._decide(step, closing.squares, grad_clip)
        self.last = step
        self.closed += 1
        return closing.lr

    async def late_round(self, step: int, grad_clip: float | None) -> float:
        """An asynchronous step that could not close on the way: every stage's norm of its held
        gradients by a round, and its decision pending for step + 2's micro-batches all the same
        (the same floats); the learning rate the step ran at. With replicas, the round sums their
        gradients (trainer.replicas) while the step before's decision goes to every peer: all of
        this step's micro-batches are back, so every peer ran their forwards at the weights it
        replaces, and a peer that has it already from a micro-batch answers as it did then."""
        if self.late is not None and step:
            await self._past_the_step_before(step)
        if not replicated(self.membership) and not self.place.tied:
            return await self._decide_held(step, grad_clip)
        before = self.pending.get(step - 1)
        handed = self.rounds.applied(step - 1, before.scale) if before is not None else asyncio.sleep(0)
        (squares, lr), _ = await asyncio.gather(summed(self.rounds, step), handed)
        if before is not None and self.pending.get(step - 1) is before:
            del self.pending[step - 1]  # every peer applied it
        self._decide(step, {0: squares}, grad_clip)
        self.last = step
        return lr

    async def switch(self, step: int, adapt: Callable[[], Awaitable[list[pb.BoundaryCodecs]]]) -> None:
        """An asynchronous run's adaptive codecs after `step`, where the pipeline drained: `adapt()`'s
        changes go to every peer with the apply round of the step before. Its decision, pending
        for the next step's micro-batches, is applied by that round; a peer that applied it
        already (a round of dc or of replicas did) only switches."""
        codecs = await adapt()
        if not codecs:
            return
        before = self.pending.pop(step - 1, None)  # none pending: every peer applied it, the scale is unused
        await self.rounds.applied(step - 1, before.scale if before is not None else 1.0, codecs)

    async def _past_the_step_before(self, step: int) -> None:
        """dc: `step`'s held norms are of its gradients compensated at the weights they will be
        applied to, which a stage has once `step` - 1 is applied there (step + 1's micro-batches
        bring that decision, and may not have reached every stage yet). So `step` - 1 is decided
        (by a round of its norms if they did not all come: the stages' weights are those its
        gradients apply to, step - 2 being applied with `step`'s micro-batches, all back) and
        applied by a round (a peer that a micro-batch brought it to answers as it did then)."""
        before = step - 1
        await self.late.by_round(before, self._held_total)
        decision = self.pending.get(before)
        if decision is not None:
            await self.rounds.applied(before, decision.scale)

    async def _held_total(self, step: int) -> float:
        return (await self._held(step))[0]

    async def _held(self, step: int) -> tuple[float, float]:
        """`step`'s norm and rate by the held round, every peer holding all of its micro-batches
        (one per stage, or a restored step): tied parameters summed across their stages."""
        if self.place.tied:
            return await summed(self.rounds, step, whole=self.micro_batches)
        return await self.rounds.held(step, self.micro_batches)

    async def reopen(self, step: int, grad_clip: float | None) -> None:
        """The stages went back to `step` (a checkpoint or the swarm's copies): none of its
        decisions is pending, but with an asynchronous schedule the stages hold the gradients of
        the step before, whose decision is made again from their norms (a round) and rides with
        step + 1's micro-batches, as it would have."""
        self.forget()
        if self.depth > 1 and step:
            await self._decide_held(step - 1, grad_clip)

    async def _decide_held(self, step: int, grad_clip: float | None) -> float:
        """`step` decided from every stage's norm of its held gradients (one round, their sum in
        stage order); the learning rate the step ran at."""
        squares, lr = await self._held(step)
        self._decide(step, {0: squares}, grad_clip)
        self.last = step
        return lr

    def _decide(self, step: int, squares: dict[int, float], grad_clip: float | None) -> None:
        """The owner's decision closing `step`, pending for the micro-batches that bring it."""
        total = 0.0
        for stage in sorted(squares):  # in stage order from 0.0, as the set_grads round sums them
            total += squares[stage]
        # a decision older than the one the next micro-batches bring is applied or never will be
        self.pending = {s: d for s, d in self.pending.items() if s > step - self.depth}
        self.pending[step] = self.place.owner.decide(self.place.session, step, clip_scale(total, [], grad_clip))

    async def ready(self, step: int) -> None:
        """Returns once the decision micro-batches of `step` bring is made, if one is coming (dc)."""
        if self.late is not None:
            await self.late.ready(step - self.depth)

    def decision_for(self, step: int) -> pb.StepDecision | None:
        """The decision micro-batches of `step` bring (the one closing the step `depth` before)."""
        return self.pending.get(step - self.depth)

    async def settle(self) -> None:
        """The pending decisions the stages' weights are past (an asynchronous schedule's last one
        is applied a step later), applied now by a round on every peer (one that a micro-batch
        brought already answers with what it did)."""
        for step in sorted(self.pending):
            if step <= self.last - (self.depth - 1):
                await self.rounds.applied(step, self.pending[step].scale)
                del self.pending[step]

    def forget(self) -> None:
        """The stages went back to an earlier state: no decision is pending."""
        self.pending, self.open, self.last = {}, {}, None
        if self.late is not None:
            self.late.forget()
