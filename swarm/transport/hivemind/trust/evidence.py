"""Evidence per hop (`train.verify`): every stage peer signs, for each attempt of a training
micro-batch, the SHA-256s of what it received and sent both ways and the digest of the gradients it
holds. The accounts travel back to the owner with the reply, each stage's ahead of its downstream's;
a stage checks its downstream's account against what it sent and received before it adds its own,
so an account that contradicts its neighbour's is the fault of the peer that passed it on. Signed
by their authors, accounts can be dropped on the way but not changed: the owner then finds, between
two runs of a micro-batch, the first stage whose equal inputs gave other outputs
(swarm.transport.hivemind.trainer.verdict)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.trust.sealed import EVIDENCE, seal, signer


def sha256(payload) -> bytes:
    return hashlib.sha256(payload).digest()


@dataclass(frozen=True)
class Hashes:
    """SHA-256s of one attempt's payloads at one stage (empty where the stage has none)."""

    forward_in: bytes
    forward_out: bytes = b""
    backward_in: bytes = b""
    backward_out: bytes = b""


@dataclass(frozen=True)
class Author:
    """Who signs: the stage peer's identity key, the run and session, its stage."""

    key: RSAPrivateKey
    run_id: str
    session: str
    stage: int


def account(author: Author, batch: MicroBatch, hashes: Hashes, digest: float, loss: float = 0.0) -> pb.Evidence:
    """`author`'s signed account of `batch`'s attempt."""
    evidence = pb.Evidence(
        run_id=author.run_id,
        session=author.session,
        step=batch.step,
        index=batch.index,
        attempt=batch.attempt,
        stage=author.stage,
        forward_in=hashes.forward_in,
        forward_out=hashes.forward_out,
        backward_in=hashes.backward_in,
        backward_out=hashes.backward_out,
        digest=digest,
        loss=loss,
    )
    return seal(author.key, evidence, EVIDENCE)


def author_of(evidence: pb.Evidence) -> str | None:
    """The peer id that signed `evidence`, or None when nobody's key did."""
    try:
        return signer(evidence, EVIDENCE)
    except ValueError:
        return None


def check_downstream(evidence, batch: MicroBatch, where: tuple[str, int, str], sent: bytes, reply: bytes) -> str | None:
    """Why the downstream account `evidence` (the first of the reply's) cannot be passed on, or None:
    `where` = (run id, its stage, the peer we sent to); `sent`/`reply`: SHA-256s of the payload we
    sent it and of the gradient payload it replied with."""
    run_id, stage, peer = where
    if not evidence:
        return f"stage {stage} peer {peer[-8:]} replied without its account of micro-batch {batch.key}"
    first = evidence[0]
    if (first.run_id, first.step, first.index, first.attempt, first.stage) != (
        run_id,
        batch.step,
        batch.index,
        batch.attempt,
        stage,
    ):
        return f"stage {stage} peer {peer[-8:]}'s account is of another micro-batch than {batch.key}"
    if first.forward_in != sent or first.backward_out != reply:
        return f"stage {stage} peer {peer[-8:]}'s account of micro-batch {batch.key} names payloads other than those exchanged"
    if author_of(first) != peer:
        return f"stage {stage} peer {peer[-8:]}'s account of micro-batch {batch.key} is not signed by it"
    return None
