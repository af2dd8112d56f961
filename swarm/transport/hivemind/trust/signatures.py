"""Control calls signed by the run's owner, and their check on the peer they are for.

A signature covers the request's kind and head, the `Auth` fields but the signature (signer's key,
time, nonce, the peer the call is for, the payload's SHA-256, checked once the payload is in) and
the payload's length and crc32 as its first chunk declares them (the chunks are checked against
those as they arrive): a signed call cannot be changed, sent to another peer, or accepted twice. What signing and checking cost is measured in
docs/security.md.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import time

from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from protocols.checksum import crc32
from protocols.errors import RemoteError
from swarm.transport.hivemind.trust.keys import peer_id_of, public_key

WINDOW_S = 60.0  # a signed call is accepted within this many seconds of its time (clocks may differ a little)
MAX_KEY_BYTES = 1024  # an RSA-2048 key in hivemind's format is about 380 bytes; longer ones are refused unread
NONCE_BYTES = 16


class Refused(RemoteError):
    """The caller may not do this; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message, pb.REFUSED)


def _signed(kind: str, head, auth: pb.Auth, total_length: int, crc: int) -> bytes:
    unsigned = pb.Auth()
    unsigned.CopyFrom(auth)
    unsigned.signature = b""
    return b"".join(
        (
            b"hivepipe.call\0",
            kind.encode(),
            b"\0",
            struct.pack("<Q", len(head_bytes := head.SerializeToString(deterministic=True))),
            head_bytes,
            unsigned.SerializeToString(deterministic=True),
            struct.pack("<QI", total_length, crc),
        )
    )


def sign_call(key: RSAPrivateKey, kind: str, head, payload: bytes, service: str) -> pb.Auth:
    """The owner's signature of a `kind` call with `head` and `payload` to the peer `service`."""
    auth = pb.Auth(
        public_key=key.get_public_key().to_bytes(),
        time=time.time(),
        nonce=secrets.token_bytes(NONCE_BYTES),
        service=service,
        payload_sha256=hashlib.sha256(payload).digest(),
    )
    auth.signature = key.sign(_signed(kind, head, auth, len(payload), crc32(payload)))
    return auth


class CallCheck:
    """A peer's check of signed calls: who signed, for this peer, fresh, never seen before."""

    def __init__(self, peer_id: str, window_s: float = WINDOW_S, clock=time.time) -> None:
        self.peer_id, self.window_s, self.clock = peer_id, window_s, clock
        self._nonces: dict[bytes, float] = {}  # nonce -> until when it is remembered

    def signer(self, kind: str, head, auth: pb.Auth, chunk: pb.Chunk, owner: str | None = None) -> str:
        """The peer id whose key signed this call (Refused if none did, or not for us, or not now,
        or, given the `owner`, anyone else): the cheap checks first, the signature last."""
        if not auth.signature:
            raise Refused(f"unsigned {kind} call: only the run's owner may make it")
        if len(auth.public_key) > MAX_KEY_BYTES or len(auth.nonce) != NONCE_BYTES:
            raise Refused(f"{kind} call with a malformed signature")
        if auth.service != self.peer_id:
            raise Refused(f"{kind} call signed for another peer ({auth.service[-8:] or 'none'})")
        now = self.clock()
        if not abs(auth.time - now) <= self.window_s:
            away = f"{now - auth.time:.0f}s" if abs(auth.time) < 1e15 else "far"
            raise Refused(f"{kind} call signed {away} away from this peer's clock (limit {self.window_s:.0f}s)")
        try:
            signer = peer_id_of(auth.public_key)
        except ValueError:
            raise Refused(f"{kind} call with a malformed signature") from None
        if owner is not None and signer != owner:
            raise Refused(f"{kind} call signed by {signer[-8:]}, not by the run's owner {owner[-8:]}")
        try:
            valid = public_key(auth.public_key).verify(
                _signed(kind, head, auth, chunk.total_length, chunk.crc32), auth.signature
            )
        except Exception:
            valid = False
        if not valid:
            raise Refused(f"{kind} call with a bad signature")
        self._forget(now)
        if auth.nonce in self._nonces:
            raise Refused(f"{kind} call replayed")
        self._nonces[bytes(auth.nonce)] = now + 2 * self.window_s
        return signer

    @staticmethod
    def payload(kind: str, auth: pb.Auth, payload: bytes) -> None:
        """Once a checked call's payload is in: it is the one signed (Refused if not)."""
        if hashlib.sha256(payload).digest() != auth.payload_sha256:
            raise Refused(f"{kind} call whose payload is not the one signed")

    def _forget(self, now: float) -> None:
        if len(self._nonces) > 1024:
            self._nonces = {n: until for n, until in self._nonces.items() if until > now}
