"""Messages signed as a whole: the run's owner's (admissions, tokens, step proofs), and a stage peer's
accounts of its micro-batches (trust.evidence): each carries the
signer's public key and a signature over the rest of it, behind a name of its kind (so a signature
of one kind is never taken for another)."""

from __future__ import annotations

from hivemind.utils.crypto import RSAPrivateKey

from swarm.transport.hivemind.trust.keys import peer_id_of, public_key

STEP = b"step"  # a step proof: the run is at a step
DECISION = b"decision"  # a step decision: the owner's word that closes a step (stage.closing)
ROSTER = b"roster"  # who serves the run, per stage (routing goes only to them)
MANIFEST = b"manifest"  # the SHA-256s of a snapshot round's copies (a restore takes only those)
EVIDENCE = b"evidence"  # a stage peer's account of one attempt of a micro-batch (train.verify)


def _unsigned(message, kind: bytes) -> bytes:
    copy = type(message)()
    copy.CopyFrom(message)
    copy.signature = b""
    return b"hivepipe." + kind + b"\0" + copy.SerializeToString(deterministic=True)


def seal(key: RSAPrivateKey, message, kind: bytes):
    """`message` with `key`'s public key and signature filled in."""
    message.public_key = key.get_public_key().to_bytes()
    message.signature = b""
    message.signature = key.sign(_unsigned(message, kind))
    return message


def signer(message, kind: bytes) -> str:
    """The peer id whose key signed `message` (ValueError when nobody's did)."""
    if len(message.public_key) > 1024 or len(message.signature) > 1024:  # RSA-2048: ~380 and 344 bytes
        raise ValueError("malformed signature")
    try:
        who = peer_id_of(message.public_key)
        valid = public_key(message.public_key).verify(_unsigned(message, kind), message.signature)
    except Exception:
        valid = False
    if not valid:
        raise ValueError("bad signature")
    return who
