"""A stage peer's signed accounts of its training micro-batches (`train.verify`, trust.evidence): the
downstream's account checked against what was exchanged with it, then ours put ahead of it.

Only with exact digests: a model given `train.verify_tolerance` (kernels that are not deterministic)
sends outputs whose bits differ between runs, so per-hop hashes could not be compared."""

from __future__ import annotations

from protocols import stage_pb2 as pb
from protocols.carried import payload_sha256
from protocols.errors import RemoteError
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.transport.hivemind.net.meta import carried_of
from swarm.transport.hivemind.stage.state import StageState
from swarm.transport.hivemind.stage.trip import Trip
from swarm.transport.hivemind.trust.evidence import Author, Hashes, account, check_downstream, sha256


class HopEvidence:
    def __init__(self, state: StageState) -> None:
        self.state = state

    def kept(self, batch: MicroBatch) -> bool:
        """Whether this micro-batch gets an account (every training one while verification is on,
        so none stands out)."""
        train = self.state.cfg.train
        return batch.mode is Mode.TRAIN and bool(train.verify) and not train.verify_tolerance

    def downstream(self, trip: Trip, target: str, reply: bytes, evidence) -> None:
        """The next stage's accounts, in `evidence`, once checked against the activations we sent
        `target` (`trip.body_out`) and its `reply`: kept in `trip` (RemoteError when they do not
        match: the downstream's fault, so our caller may try us again)."""
        place = self.state.place
        sent, replied = payload_sha256(carried_of(trip.batch), trip.body_out), sha256(reply)
        where = (place.run_id, place.stage + 1, target)
        fault = check_downstream(evidence, trip.batch, where, sent, replied)
        if fault is not None:
            raise RemoteError(f"stage {place.stage + 1}: {fault}", pb.DOWNSTREAM)
        trip.hashes = (sent, replied)
        trip.downstream = list(evidence)

    def ours(self, trip: Trip, received, outcome, digest: float) -> list:
        """Our signed account of `trip` (`received`: its request's payload; `outcome`: our reply)
        ahead of the downstream's."""
        place = self.state.place
        sent, reply = trip.hashes
        hashes = Hashes(sha256(received), sent, reply, sha256(outcome.payload) if not place.first else b"")
        author = Author(place.node.identity, place.run_id, self.state.session_id, place.stage)
        loss = float(outcome.metrics.get("loss", 0.0)) if place.last else 0.0
        return [account(author, trip.batch, hashes, digest, loss), *trip.downstream]
