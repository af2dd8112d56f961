"""A hosted stage's checks of every call, made on its head before any payload is read.

- control calls (setup, the step's rounds, checkpoints, copies): signed by the run's owner;
- micro-batches: from a member admitted to the stage before (stage 0: from the session's trainer);
- state downloads: from a member of the session (a joiner of the stage, a holder of copies) that
  the owner's newest roster lists, as a micro-batch's sender must be;
- status (`info`): anyone.

The owner is the one given (`--owner`, or the signer of the run's published config), else the
first to set the stage up (trust on first use: the peer logs whom it trusts and how to pin it).
"""

from __future__ import annotations

import logging
import time

from protocols import stage_pb2 as pb
from protocols.calls import OWNER_CALLS
from protocols.errors import ProtocolError, RemoteError
from swarm.transport.hivemind.trust import sealed
from swarm.transport.hivemind.trust.admissions import Admissions
from swarm.transport.hivemind.trust.signatures import CallCheck, Refused

log = logging.getLogger(__name__)

EPOCH_AHEAD_S = 600  # a link epoch further ahead of our clock would make the sender's later epochs stale


class Gate:
    def __init__(self, run_id: str, stage: int, peer_id: str, owner: str | None = None) -> None:
        self.run_id, self.stage, self.peer_id = run_id, stage, peer_id
        self.owner = owner
        self.calls = CallCheck(peer_id)
        self.admissions = Admissions(run_id)
        self.admission: pb.Admission | None = None  # ours, from the setup of the current session
        self.roster: pb.Roster | None = None  # the newest the owner showed us (routing goes only to its peers)
        self._listed: dict[int, set[str]] = {}  # of `roster`: stage -> its peers
        self._verifiers: set[str] = set()  # of `roster`: the peers that take checks only

    def control(self, kind: str, head, auth: pb.Auth, chunk: pb.Chunk) -> None:
        assert kind in OWNER_CALLS
        signer = self.calls.signer(kind, head, auth, chunk, self.owner)
        if self.owner is None and kind != "setup":
            raise RemoteError(f"{kind} call before any setup: this peer has no owner to check it against", pb.NOT_READY)
        if kind == "setup":  # the first setup's signer becomes the owner once the setup succeeded (set_up)
            own = self.admissions.check(head.admission, self.owner or signer, head.session, self.peer_id)
            if own.trainer or own.stage != self.stage:
                raise Refused(f"setup admits this peer to stage {own.stage}, it hosts stage {self.stage}")

    def micro_batch(self, head: pb.MicroBatchHead, sender: str, session: str) -> None:
        admission = self.admissions.check(head.admission, self.owner, session, sender)
        if head.epoch > time.time_ns() + EPOCH_AHEAD_S * 10**9:  # epochs are the sender's clock when it began a link
            raise ProtocolError(f"link epoch {head.epoch} is ahead of this peer's clock by more than {EPOCH_AHEAD_S}s")
        if self.stage == 0 and not admission.trainer:
            raise Refused(f"micro-batch for stage 0 from {sender[-8:]}, not the session's trainer")
        if self.stage > 0 and (admission.trainer or admission.stage != self.stage - 1):
            who = "the trainer" if admission.trainer else f"a stage {admission.stage} peer"
            raise Refused(f"micro-batch for stage {self.stage} from {who}; only stage {self.stage - 1} peers send here")

    def state(self, head: pb.StateRequest, sender: str, session: str) -> None:
        # the copies belong to the owner's lineage, not to one session: a restore may fetch one
        # from a holder its trainer has not set up again yet
        admission = self.admissions.check(head.admission, self.owner, None if head.snapshot else session, sender)
        if admission.trainer or (not head.snapshot and admission.stage != self.stage):
            raise Refused(f"state of stage {self.stage} asked by a member of stage {admission.stage}")
        # a member the owner left out keeps its admission: the roster says who is one now, as it
        # does for micro-batches (a joiner shows the roster of its setup, which lists it)
        if head.HasField("roster") and head.roster.session == session:
            self.show_roster(head.roster, session)
        if not self.listed(admission.stage, sender, admission.session):
            raise Refused(
                f"state of stage {self.stage} asked by {sender[-8:]}: the owner's roster no longer has it serving stage {admission.stage}"
            )

    def owners(self, message, kind: bytes, session: str) -> bool:
        """Whether `message` (a step proof or decision) is sealed by the run's owner for `session`."""
        try:
            signer = sealed.signer(message, kind)
        except ValueError:
            return False
        return signer == self.owner and (message.run_id, message.session) == (self.run_id, session)

    def step_shown(self, proof: pb.StepProof, session: str, step: int) -> bool:
        """Whether `proof` is the owner's word that `session` is at `step` (a neighbour's word is not)."""
        return self.owners(proof, sealed.STEP, session) and proof.step == step

    def show_roster(self, roster: pb.Roster, session: str) -> None:
        """A micro-batch brought the owner's roster: kept when it is newer than ours for `session`
        (a neighbour cannot make one up, nor bring back an older one to route to a member left out)."""
        known = self.roster
        if known is not None and known.session == session:
            if roster.epoch < known.epoch or roster.signature == known.signature:
                return
        if roster.session != session or not self.owners(roster, sealed.ROSTER, session):
            raise Refused("a roster not signed by the run's owner for this session")
        self.roster = pb.Roster()
        self.roster.CopyFrom(roster)
        self._listed = {entry.stage: set(entry.peers) for entry in roster.stages}
        self._verifiers = {peer for entry in roster.stages for peer in entry.verifiers}

    def listed(self, stage: int, peer_id: str, session: str) -> bool:
        """Whether the owner's newest roster for `session` has `peer_id` serving `stage` (True
        before any roster came: the admission decides then)."""
        if self.roster is None or self.roster.session != session:
            return True
        return peer_id in self._listed.get(stage, ())

    def verifier(self, peer_id: str) -> bool:
        """Whether the owner's newest roster names `peer_id` a verifier (it takes checks only)."""
        return peer_id in self._verifiers

    def shown(self) -> pb.Admission:
        """Ours, to show with a call (empty before the first setup: the callee refuses it)."""
        return self.admission if self.admission is not None else pb.Admission()

    def confirm(self, head: pb.SetupRequest) -> None:
        """Before a setup runs (one at a time): one checked while no owner was known is still the
        owner's, now that another setup may have made someone the owner."""
        if self.owner is not None and self.admissions.signer(head.admission) != self.owner:
            raise Refused("setup by someone other than the run's owner, who set this peer up meanwhile")

    def set_up(self, head: pb.SetupRequest) -> None:
        """A setup (checked by `control`) succeeded: its admission is ours, its signer our owner."""
        if self.owner is None:
            self.owner = self.admissions.signer(head.admission)
            log.info(
                "stage %d of run %r: owner %s (the first to set it up; pass --owner %s to pin it)",
                self.stage,
                self.run_id,
                self.owner,
                self.owner,
            )
        self.admission = pb.Admission()
        self.admission.CopyFrom(head.admission)
        if head.HasField("roster"):  # it lists this peer: shown with its state downloads
            self.show_roster(head.roster, head.session)

    def state_request(self, **fields) -> pb.StateRequest:
        """A state download's request, with our admission and the newest roster we hold."""
        request = pb.StateRequest(admission=self.shown(), **fields)
        if self.roster is not None:
            request.roster.CopyFrom(self.roster)
        return request
