"""Which peers a check's second run avoids, told only to the peers that route it (`train.verify`).

A check runs a micro-batch again through another peer of the checked stage: the peer of the stage
before must not hand it to the first run's peer. Were the avoided peers named in the clear, every
stage on the route would know the micro-batch is a check (and which stage is checked). Instead the
owner gives each member, with its setup, a key of its own, and a check names each avoided peer once
per peer of the stage before, as HMAC-SHA-256(that peer's key, attempt || avoided peer id); every
training micro-batch carries at least AVOID_SLOTS such tokens, random ones where nothing is avoided.
A stage peer finds, among its next stage's peers, those its own key names; the others learn nothing
from the tokens. (A second run is still a second attempt of a (step, index), as a retry is.)"""

from __future__ import annotations

import hashlib
import hmac
import os

AVOID_SLOTS = 8  # tokens every training micro-batch carries (a multiple of it for larger checks)
TOKEN_BYTES = 16
KEY_BYTES = 32


class CheckKeys:
    """The owner's: each member's check key, derived from a secret of this trainer process (a
    setup sent again gives the same key)."""

    def __init__(self) -> None:
        self._secret = os.urandom(KEY_BYTES)

    def of(self, session: str, peer_id: str) -> bytes:
        return hmac.digest(self._secret, f"{session}\0{peer_id}".encode(), "sha256")


def token(key: bytes, attempt: bytes, peer_id: str) -> bytes:
    return hmac.digest(key, attempt + b"\0" + peer_id.encode(), "sha256")[:TOKEN_BYTES]


def avoid_tokens(keys: list[bytes], attempt: bytes, avoided: list[str]) -> list[bytes]:
    """The tokens of a micro-batch's attempt that tell each holder of `keys` (the peers that route
    to the checked stage) to avoid `avoided`, among random ones; only random ones when nothing is."""
    real = [token(key, attempt, peer) for key in keys for peer in avoided]
    slots = max(AVOID_SLOTS, -(-len(real) // AVOID_SLOTS) * AVOID_SLOTS)
    tokens = real + [os.urandom(TOKEN_BYTES) for _ in range(slots - len(real))]
    order = sorted(range(len(tokens)), key=lambda i: hashlib.sha256(tokens[i]).digest())  # real ones not first
    return [tokens[i] for i in order]


def avoided(key: bytes, attempt: bytes, tokens, candidates) -> set[str]:
    """Of `candidates` (peer ids), those the tokens tell the holder of `key` to avoid."""
    if not key or not tokens:
        return set()
    named = {bytes(t) for t in tokens}
    return {peer for peer in candidates if token(key, attempt, peer) in named}
