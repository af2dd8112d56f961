"""A step that closes on the way, with no round trip from the trainer on its critical path.

The trainer's rounds (gather, set_grads, apply: swarm.transport.hivemind.stage.rounds) cost three
round trips after every step; at 50 ms of latency that is 0.3 s a step. When every stage has one
peer, no parameter is tied across stages and the codecs are fixed, nothing a step needs crosses
stages but the gradients' squared norm (for clipping) and the owner's word that the step is over,
so those travel with the micro-batches instead:

1. each training micro-batch of the step says how many the step has (`closing`);
2. a stage peer that finished the backward of all of them sums their gradients (in index order, as
   the gather round would) and adds the squared norm to that micro-batch's reply, which carries it
   up the chain with the norms of the stages after it (`finished`); the trainer adds them up;
3. the trainer decides (the clipping scale) and signs the decision; the next step's micro-batches
   bring it, and each stage peer applies it before the first of them (`decided`), as an apply round
   would. The trainer applies a decision by a round instead when it needs the step applied before
   any micro-batch comes (a joiner's download, a copy, a checkpoint, the run's end).

The floats are those of the rounds. A step whose micro-batches were retried or run again, or whose
norms did not all arrive, closes by the rounds (held gradients are summed again, so nothing counts
twice).

With an asynchronous schedule (swarm.engine.delay) the decision closing step t comes with step
t + 2's micro-batches, and step t + 1's may be in flight meanwhile: two steps are open here at once,
a step's norm is taken from its held gradients without touching the parameters' (`held_sq_norm`:
the same floats), and the apply sums them (stage.rounds). The learning rate a step reports is the
one its micro-batches ran at: the rate the one-process engine's step t applies g_{t-1} with. A step
that cannot close on the way is counted by a round instead (the gather round's `held` form:
stage.combine), and a restored state holds its last step's gradients again (StageState.restored):
either way its decision applies them (`StageState.counted`).

With dc (swarm.engine.versions) the gradients clipping sees are step t's compensated at the weights
they are applied to, v_{t+1}, which a stage has only once step t - 1 is applied here, when step
t + 1's first micro-batch comes: their norm rides back with the first of step t + 1's micro-batches
to finish here (its backward is after all of step t's), under `LATE` (the trainer's decision waits
for it: trainer.closing).
"""

from __future__ import annotations

import asyncio

from protocols import stage_pb2 as pb
from protocols.wire_names import LATE, LR, RERUN, SQUARE
from swarm.config.schedule import DelayCorrection
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.engine.stage import step_keys
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.rounds import StageRounds
from swarm.transport.hivemind.trust.sealed import DECISION
from swarm.transport.hivemind.trust.signatures import Refused


class Closing:
    def __init__(self, parts: StageParts, rounds: StageRounds) -> None:
        self.place, self.state, self.work, self.gate = parts.place, parts.state, parts.work, parts.gate
        self.rounds = rounds
        state = self.state
        # (the state's generation, step) -> its micro-batches whose backward finished here; a new
        # session or a restored state is a new generation: a replayed step counts afresh
        self.done: dict[tuple[int, int], set[int]] = {}
        self.reported: list[tuple[int, int]] = []  # the steps whose norm this peer reported last
        # steps open at once: two with an asynchronous schedule, whose steps' learning rates are
        # those at their first micro-batch here (`StageState.rates`)
        self.depth = 2 if state.cfg.train.schedule == "async" else 1
        self.twice: tuple[int, int] | None = None  # a step of which a micro-batch finished twice before its sum
        self._applying: dict[tuple[int, int], asyncio.Task] = {}
        self.late_sent: list[tuple[int, int]] = []  # the steps whose norm `LATE` reported (dc)
        # dc's norms come a step late (`_late`); parsed once, not per micro-batch
        self.late = self.depth > 1 and DelayCorrection.parse(state.cfg.train.delay_correction).kind == "dc"

    async def finished(self, batch: MicroBatch, closing: int, metrics: dict[str, float]) -> dict[str, float]:
        """After a micro-batch's backward here: its reply's metrics, with this stage's squared
        gradient norm (`grad_sq:<stage>`, and the learning rate its step will use) added when it was
        the last of its step's `closing` micro-batches to finish here. A micro-batch that finishes
        here again (its reply was lost and it was retried) says so (`step_rerun`): what was reported
        may not be what is held now, and the step closes by the rounds."""
        key = (self.state.generation, batch.step)
        if not closing or batch.mode is not Mode.TRAIN:
            return metrics
        if self.late:
            metrics = await self._late(batch, metrics)
        done = self.done.get(key)
        if done is None:
            done = self._begin(key)
        if batch.index in done or key in self.reported:
            if key not in self.reported:  # what is held may be either attempt's: only the rounds can tell
                self.twice = key
            return {**metrics, RERUN: 1.0}
        done.add(batch.index)
        if len(done) < closing:
            return metrics
        if self.twice == key:
            return {**metrics, RERUN: 1.0}
        self.reported = [*self.reported, key][-self.depth :]
        summed = await self.work.run(self.work.timed, self._sum, batch.step, closing)
        if summed is None:
            return {**metrics, RERUN: 1.0}
        square, lr = summed
        return {**metrics, LR: lr, **({} if square is None else {f"{SQUARE}{self.place.stage}": square})}

    async def _late(self, batch: MicroBatch, metrics: dict[str, float]) -> dict[str, float]:
        """dc: the first micro-batch of a step to finish here brings the norm of the step before's
        compensated gradients (step t - 1 applied here, step t not yet: `state.steps` is t)."""
        key = (self.state.generation, batch.step - 1)
        if batch.step < 1 or key in self.late_sent or self.state.steps != key[1]:
            return metrics
        self.late_sent = [*self.late_sent, key][-self.depth :]
        keys = step_keys(key[1], self.state.cfg.train.micro_batches)
        try:
            square = await self.work.run(self.work.timed, self.state.runtime.held_sq_norm, keys)
        except KeyError:
            return {**metrics, RERUN: 1.0}
        return {**metrics, f"{LATE}{self.place.stage}": square}

    def _begin(self, key: tuple[int, int]) -> set[int]:
        kept = list(self.done.items())[1 - self.depth :] if self.depth > 1 else []
        self.done = {**dict(kept), key: set()}  # `depth` steps at a time: what earlier ones left goes
        return self.done[key]

    def entered(self, batch: MicroBatch) -> None:
        """A micro-batch, past its decision: an asynchronous step's learning rate is the one its
        first micro-batch found here (later updates may come before its norm is reported)."""
        if self.depth > 1 and batch.mode is Mode.TRAIN:
            key, rates = (self.state.generation, batch.step), self.state.rates
            if key not in rates:
                self.state.rates = {**dict(list(rates.items())[-self.depth :]), key: self._lr()}

    def _lr(self) -> float:
        return self.state.runtime.optimizer.param_groups[0]["lr"]

    def _sum(self, step: int, count: int) -> tuple[float, float] | None:
        """On the computing thread: the step's gradients (its micro-batches' held ones, in index
        order) and their squared norm; the learning rate the step will be applied with. None when
        a micro-batch's gradients are no longer held (a retry of it failed here)."""
        runtime = self.state.runtime
        keys = step_keys(step, count)
        try:
            if self.depth > 1:  # an earlier step may not be applied yet: its p.grad are not ours
                square = None if self.late else runtime.held_sq_norm(keys)  # dc's comes later (`_late`)
                return square, self.state.rates.get((self.state.generation, step), self._lr())
            runtime.accumulate(keys)
        except KeyError:
            return None
        return runtime.grad_sq_norm(), self._lr()

    async def decided(self, decision: pb.StepDecision) -> None:
        """A micro-batch brought the owner's decision closing `decision.step`: applied once, before
        the micro-batch is served (its fellows wait for the same apply)."""
        state = self.state
        if decision.step != state.steps or state.joining is not None or state.leaving:
            return  # applied already (by a round, or by another micro-batch), or not ours to apply
        key = (state.generation, decision.step)  # a state restored to an earlier step applies it anew
        if key not in self.reported and key not in state.counted:
            return  # the step's gradients are not all here (a decision replayed after a restore)
        task = self._applying.get(key)
        if task is None:
            self._check(decision)
            request = pb.ApplyRequest(step=decision.step, scale=decision.scale)
            task = asyncio.ensure_future(self.rounds.handle("apply", request, b""))
            self._applying = {key: task}
        await asyncio.shield(task)

    def _check(self, decision: pb.StepDecision) -> None:
        if not self.gate.owners(decision, DECISION, self.state.session_id):
            raise Refused("a step decision not signed by the run's owner for this session")
