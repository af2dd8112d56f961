"""The trainer's side of a step that closes on the way (swarm.transport.hivemind.stage.closing): which
steps may, the norms their micro-batches' replies bring, and the owner's decision the next step's
micro-batches carry.

A step closes on the way when every stage has one peer in service, no parameter is tied across
stages and the codecs are fixed (`plan`); else, or when its micro-batches were retried or run
again, or a stage's norm did not come back, it closes by the rounds (swarm.engine.step), with the
same floats. A decision no micro-batch has brought yet is applied by a round (`settle`) before
anything that needs every stage past the step: admitting a joiner (it downloads a stage's state), a
copy, a checkpoint, the run's end.
"""

from __future__ import annotations

from protocols import stage_pb2 as pb
from swarm.engine.step import clip_scale
from swarm.transport.hivemind.stage.closing import LR, RERUN, SQUARE
from swarm.transport.hivemind.trainer.membership import Membership, TrainerPlace
from swarm.transport.hivemind.trainer.rounds import SwarmRounds


class StepClosing:
    def __init__(
        self, place: TrainerPlace, membership: Membership, rounds: SwarmRounds, micro_batches: int, fixed_codecs: bool
    ) -> None:
        self.place, self.membership, self.rounds = place, membership, rounds
        self.micro_batches, self.fixed_codecs = micro_batches, fixed_codecs
        self.step: int | None = None  # the step whose micro-batches are out, closing on the way
        self.squares: dict[int, float] = {}  # stage -> its squared gradient norm, as reported
        self.lr: float | None = None
        self.clean = False  # no micro-batch of the step retried or run again
        self.pending: pb.StepDecision | None = None  # the last decision, until a micro-batch brought it
        self.closed = 0  # steps closed on the way (the summary's count)
        self._retries = 0  # the handoff's retries when the step's micro-batches went out

    def plan(self, step: int, count: int, retries: int) -> int:
        """How many micro-batches the step's heads say it has (0: it closes by the rounds)."""
        members = self.membership
        alone = all(len(members.members.get(s, [])) == 1 for s in range(self.place.num_stages))
        eligible = alone and not members.following and not self.place.tied and self.fixed_codecs
        if not eligible or count != self.micro_batches:
            self.step = None
            return 0
        self.step, self.squares, self.lr, self.clean, self._retries = step, {}, None, True, retries
        return count

    def heard(self, step: int, metrics: dict[str, float], decision: pb.StepDecision | None) -> dict[str, float]:
        """A micro-batch of `step`, sent with `decision`, came back with these metrics: what they
        report of the step's closing is taken out (the rest is the loop's)."""
        if decision is not None and decision is self.pending:
            self.pending = None  # every stage applied it before serving the micro-batch
        ours = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(SQUARE) or k in (RERUN, LR)]}
        if step != self.step:
            return metrics
        if RERUN in ours:
            self.clean = False
        for key, value in ours.items():
            if key.startswith(SQUARE):
                self.squares[int(key.removeprefix(SQUARE))] = value
        self.lr = ours.get(LR, self.lr)
        return metrics

    def rerun(self) -> None:
        """Micro-batches of the step run again (a peer that ran them left): it closes by the rounds."""
        self.clean = False

    def close(self, step: int, grad_clip: float | None, retries: int) -> float | None:
        """The learning rate of `step` closed on the way (its decision now pending for the next
        step's micro-batches), or None: it closes by the rounds."""
        on_the_way = (
            step == self.step
            and self.clean
            and retries == self._retries
            and sorted(self.squares) == list(range(self.place.num_stages))
            and self.lr is not None
        )
        self.step = None
        if not on_the_way:
            return None
        squares = 0.0
        for stage in sorted(self.squares):  # in stage order from 0.0, as the set_grads round sums them
            squares += self.squares[stage]
        self.pending = self.place.owner.decide(self.place.session, step, clip_scale(squares, [], grad_clip))
        self.closed += 1
        return self.lr

    def decision_for(self, step: int) -> pb.StepDecision | None:
        """The decision micro-batches of `step` bring (the one closing the step before)."""
        return self.pending if self.pending is not None and self.pending.step + 1 == step else None

    async def settle(self) -> None:
        """The pending decision, applied now by a round on every peer (one that a micro-batch
        brought already answers with what it did)."""
        decision = self.pending
        if decision is not None:
            await self.rounds.applied(decision.step, decision.scale)
            self.pending = None

    def forget(self) -> None:
        """The stages went back to an earlier state: no decision is pending."""
        self.pending, self.step = None, None
