"""Admissions: the owner's signed word that a peer serves a stage (or is the trainer) in one session.

The trainer issues one to every peer it sets up (inside the signed setup call) and one to itself;
a member shows its own with every micro-batch and state download, and in its DHT record. A peer
checks the admission against the run's owner, the run, its own session, and the peer id the
transport authenticated: a copied admission is worth nothing to another peer.
"""

from __future__ import annotations

from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.transport.hivemind.trust import sealed
from swarm.transport.hivemind.trust.sealed import seal
from swarm.transport.hivemind.trust.signatures import Refused


def issue(key: RSAPrivateKey, run_id: str, session: str, peer_id: str, stage: int = 0, trainer: bool = False):
    admission = pb.Admission(run_id=run_id, session=session, peer_id=peer_id, stage=stage, trainer=trainer)
    return seal(key, admission, b"admission")


class Admissions:
    """Checks admissions of one run, remembering those verified (a member shows the same one often)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._verified: dict[bytes, str] = {}  # serialized admission -> its signer

    def signer(self, admission: pb.Admission) -> str:
        """The peer id that signed `admission` (Refused when its signature is bad)."""
        if admission.ByteSize() > 4096:  # a real one is under 1 KiB: nothing larger is kept
            raise Refused("admission of more than 4096 bytes")
        data = admission.SerializeToString(deterministic=True)
        signer = self._verified.get(data)
        if signer is None:
            try:
                signer = sealed.signer(admission, b"admission")
            except ValueError:
                raise Refused("admission with a bad signature") from None
            if len(self._verified) > 4096:
                self._verified.clear()
            self._verified[data] = signer
        return signer

    def check(self, admission: pb.Admission, owner: str | None, session: str | None, peer_id: str) -> pb.Admission:
        """`admission` if it admits `peer_id` to this run's `session` (None: any) by `owner` (Refused if not)."""
        if not admission.signature:
            raise Refused(f"peer {peer_id[-8:]} showed no admission to run {self.run_id!r}")
        signer = self.signer(admission)
        if owner is None or signer != owner:
            raise Refused(f"admission signed by {signer[-8:]}, not by the run's owner")
        if admission.run_id != self.run_id:
            raise Refused(f"admission to run {admission.run_id!r}, not {self.run_id!r}")
        if admission.peer_id != peer_id:
            raise Refused(f"admission of peer {admission.peer_id[-8:]} shown by {peer_id[-8:]}")
        if (
            session is not None and admission.session != session
        ):  # a member of an earlier or later session: maybe another peer is in ours
            raise RemoteError(f"admission to another session of run {self.run_id!r}", pb.UNAVAILABLE)
        return admission

    def routable(self, data: bytes, owner: str | None, session: str, peer_id: str, stage: int) -> bool:
        """Whether a DHT record's admission (serialized) makes `peer_id` a peer of `stage` in
        `session`: anyone can announce, only those admitted are routed to."""
        try:
            admission = self.check(pb.Admission.FromString(data), owner, session, peer_id)
        except Exception:
            return False
        return not admission.trainer and admission.stage == stage
