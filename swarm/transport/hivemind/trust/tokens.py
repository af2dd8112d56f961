"""Tokens: a private run's owner lets one peer in by name, for a while, without telling the trainer.

`python -m peers.token --run_id RUN --peer PEER_ID --expires 7d` prints one (signed with the owner's
key); the joiner passes it (`peers.stage --token ...`) and its DHT record carries it, so the
trainer of a private run (`--private`, or `--allow`) sets up peers it allows by name or by token.
"""

from __future__ import annotations

import base64
import re
import time

from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.trust import sealed
from swarm.transport.hivemind.trust.sealed import seal

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in "90", "30m", "12h", "7d", "2w" (ValueError otherwise)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration (e.g. 3600, 30m, 12h, 7d)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def issue_token(key: RSAPrivateKey, run_id: str, peer_id: str, expires_in_s: float | None = None) -> str:
    token = pb.Token(run_id=run_id, peer_id=peer_id, expires=time.time() + expires_in_s if expires_in_s else 0.0)
    return base64.urlsafe_b64encode(seal(key, token, b"token").SerializeToString()).decode()


def read_token(text: str) -> pb.Token:
    """The token in `text` (ValueError with a one-line reason)."""
    try:
        token = pb.Token.FromString(base64.urlsafe_b64decode(text.strip().encode()))
    except Exception:
        raise ValueError("not a hivepipe token (python -m peers.token prints them)") from None
    try:
        sealed.signer(token, b"token")
    except ValueError:
        raise ValueError("the token's signature is not valid") from None
    return token


def token_owner(token: pb.Token) -> str:
    return sealed.signer(token, b"token")


def allows(data: bytes, owner: str, run_id: str, peer_id: str, now: float | None = None) -> bool:
    """Whether a serialized token lets `peer_id` into `owner`'s run now."""
    try:
        token = read_token(base64.urlsafe_b64encode(bytes(data)).decode())
    except ValueError:
        return False
    now = time.time() if now is None else now
    fresh = token.expires == 0 or now < token.expires
    return fresh and token_owner(token) == owner and token.run_id == run_id and token.peer_id == peer_id
