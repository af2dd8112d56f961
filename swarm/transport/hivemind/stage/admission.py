"""Whether a stage peer takes a micro-batch now: its sender still serves the stage before (the
owner's roster), the peer is in service (not joining, not leaving) and its weights are at the
micro-batch's step. Checked by the chain (stage.chain) on each micro-batch's way in."""

from __future__ import annotations

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from protocols.wire_names import OUTRUN
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.state import leave_session
from swarm.transport.hivemind.trust.signatures import Refused


class Admission:
    def __init__(self, parts: StageParts) -> None:
        self.place, self.state, self.meters = parts.place, parts.state, parts.meters
        self.gate, self.peer, self.stage = parts.gate, parts.peer, parts.place.stage

    def check(self, batch: MicroBatch, head: pb.MicroBatchHead, sender: str) -> None:
        """Raises unless this peer takes `batch` now. A peer behind the run missed a step's rounds
        (its trainer left it out after a failure): shown so by the owner's step proof in `head`, it
        goes idle, and the trainer sets it up afresh as a joiner. The owner's roster in `head` is
        kept (routing follows it), and a `sender` it no longer lists is refused (a member left out
        keeps its admission)."""
        state = self.state
        if head.HasField("roster"):
            self.gate.show_roster(head.roster, state.session_id)
        if self.stage > 0 and not self.gate.listed(self.stage - 1, sender, state.session_id):
            raise Refused(
                f"micro-batch from {sender[-8:]}: the owner's roster no longer has it serving stage {self.stage - 1}"
            )
        if state.joining is not None or state.leaving:
            raise RemoteError(f"stage {self.stage} peer is {state.role}: it takes no micro-batch", pb.UNAVAILABLE)
        low, high = state.serving()
        if batch.mode is Mode.TRAIN and state.runtime.stash.serves(batch.step):
            low = batch.step  # an asynchronous step's, after the next step's first moved the weights on
        if batch.step < low:  # the sender's mistake (or replay), not this peer's: refused, and
            # its upstream does not take this peer for unavailable (it may be the stage's only one)
            at = f"is at step {state.steps}"  # an asynchronous step's micro-batch sent again after the next step's moved the weights on
            if state.cfg.train.schedule == "async":
                at = f"serves step {high} (train.schedule async: its weights moved on, {OUTRUN})"
            raise RemoteError(
                f"a micro-batch of a past step: stage {self.stage} peer {at}, micro-batch {batch.key}",
                pb.REFUSED,
            )
        if batch.mode is Mode.TRAIN and batch.index >= state.cfg.train.micro_batches:
            raise RemoteError(  # no step has it: it would count toward none, and cost compute here
                f"micro-batch {batch.key} is not one of the step's {state.cfg.train.micro_batches}", pb.REFUSED
            )
        if not low <= batch.step <= high:
            shown = self.gate.step_shown(head.step_proof, state.session_id, batch.step)
            if batch.step > high and shown:  # out of the run until its trainer sets it up again (as a joiner)
                leave_session(
                    self.place, state, self.peer, f"it is at step {state.steps}, the run at step {batch.step}"
                )
            state.serves(batch.step, f"micro-batch {batch.key}")
        self.meters.first_batch(state.joined is not None, self.stage)
