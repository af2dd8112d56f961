"""The run's owner as the trainer acts: the key that signs its control calls and admits members."""

from __future__ import annotations

import logging

from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.trust import tokens
from swarm.transport.hivemind.trust.admissions import Admissions, issue
from swarm.transport.hivemind.trust.check_tokens import CheckKeys
from swarm.transport.hivemind.trust.keys import own_peer_id
from swarm.transport.hivemind.trust.sealed import DECISION, ROSTER, STEP, seal

log = logging.getLogger(__name__)


class Owner:
    """`private`: only peers in `allow`, or with a token of this owner, are set up (`allows`)."""

    def __init__(self, key: RSAPrivateKey, run_id: str, allow=(), private: bool = False) -> None:
        self.key, self.run_id = key, run_id
        self.peer_id = own_peer_id(key)  # what stage peers pin (`--owner`)
        self.admissions = Admissions(run_id)
        self._issued: dict[tuple, pb.Admission] = {}
        self.allow, self.private = set(allow), private or bool(allow)
        self._ignored: set[str] = set()  # peers refused (said once)
        self._proof: pb.StepProof | None = None
        self._roster: pb.Roster | None = None
        self.check_keys = CheckKeys()  # each member's key for the avoid tokens of our checks

    def allows(self, record) -> bool:
        """Whether the run may take this announced peer: any (an open run), or one allowed by name or
        by a token of ours (a private one). Peers not allowed are never set up nor routed to."""
        if not self.private or record.peer_id in self.allow:
            return True
        if tokens.allows(record.token, self.peer_id, self.run_id, record.peer_id):
            return True
        if record.peer_id not in self._ignored and len(self._ignored) < 1000:  # said once, for so many
            self._ignored.add(record.peer_id)
            log.warning(
                "peer %s announced stage %d of private run %r without an allowance: ignored (--allow it, or give it a token: python -m peers.token --run_id %s --peer %s)",
                record.peer_id,
                record.stage,
                self.run_id,
                self.run_id,
                record.peer_id,
            )
        return False

    def admit(self, session: str, peer_id: str, stage: int = 0, trainer: bool = False) -> pb.Admission:
        """The admission of `peer_id` to `stage` (or as the trainer) in `session`, signed once."""
        key = (session, peer_id, stage, trainer)
        if key not in self._issued:
            self._issued[key] = issue(self.key, self.run_id, session, peer_id, stage, trainer)
        return self._issued[key]

    def step_proof(self, session: str, step: int) -> pb.StepProof:
        """The owner's word that `session` is at `step` (signed once per step)."""
        if self._proof is None or (self._proof.session, self._proof.step) != (session, step):
            self._proof = seal(self.key, pb.StepProof(run_id=self.run_id, session=session, step=step), STEP)
        return self._proof

    def roster(self, session: str, epoch: int, members: dict[int, list[str]], verifiers=()) -> pb.Roster:
        """The owner's word that `members` serve `session` as of `epoch`, the `verifiers` among them
        for checks only (signed once per epoch)."""
        if self._roster is None or (self._roster.session, self._roster.epoch) != (session, epoch):
            stages = [
                pb.RosterStage(stage=stage, peers=peers, verifiers=[p for p in peers if p in verifiers])
                for stage, peers in sorted(members.items())
            ]
            roster = pb.Roster(run_id=self.run_id, session=session, epoch=epoch, stages=stages)
            self._roster = seal(self.key, roster, ROSTER)
        return self._roster

    def decide(self, session: str, step: int, scale: float) -> pb.StepDecision:
        """The owner's decision closing `step` of `session`: its gradients times `scale` (0: as they are)."""
        return seal(self.key, pb.StepDecision(run_id=self.run_id, session=session, step=step, scale=scale), DECISION)

    def routable(self, record, session: str) -> bool:
        """Whether a DHT record's peer is admitted to `session` (micro-batches go only to those)."""
        return self.admissions.routable(record.admission, self.peer_id, session, record.peer_id, record.stage)
