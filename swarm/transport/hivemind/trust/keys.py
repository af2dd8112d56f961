"""Identities: RSA keys in hivemind's identity-file format and the libp2p peer ids they stand for.

One file is one identity: a stage peer's `--identity_path` is its libp2p identity (its peer id) and
the key it signs its DHT records with; a trainer's is the run owner's key, which signs control
calls and admissions. A peer id is derived from its public key as libp2p does, so a signature
names the peer that made it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey


def default_owner_path() -> Path:
    """Where a trainer keeps the owner's key unless told (HIVEPIPE_HOME, else ~/.hivepipe)."""
    return Path(os.environ.get("HIVEPIPE_HOME", "~/.hivepipe")).expanduser() / "owner.key"


class IdentityError(RuntimeError):
    """An identity file that cannot be read or written; the message is one line."""


def _wrap(private_key) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = private_key
    return key


def write_identity(path: str | Path, key: RSAPrivateKey) -> bool:
    """`key` as hivemind writes identities (a libp2p PrivateKey message), readable by its owner
    only; written whole, then linked into place: False (and nothing written) if `path` exists."""
    path = Path(path)
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(temporary, path)  # atomic, and never over another's key
        except FileExistsError:
            return False
        finally:
            os.unlink(temporary)
    except OSError as e:
        raise IdentityError(f"cannot create identity file {path}: {e.strerror}") from None
    return True


def load_identity(path: str | Path, create: bool = True) -> RSAPrivateKey:
    """The key in `path` (created with a new key when missing and `create`)."""
    path = Path(path)
    if not path.exists() and create:
        write_identity(path, RSAPrivateKey())
    elif not path.exists():
        raise IdentityError(f"no identity file at {path}")
    try:
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        return _wrap(serialization.load_der_private_key(message.data, password=None))
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from None
    except Exception as e:
        raise IdentityError(f"{path} is not an identity file (hivemind's RSA format): {e}") from None


@functools.lru_cache(maxsize=4096)
def peer_id_of(public_key: bytes) -> str:
    """The base58 libp2p peer id of an RSA public key in hivemind's format (OpenSSH text);
    ValueError for anything else."""
    try:
        loaded = serialization.load_ssh_public_key(bytes(public_key))
    except Exception:
        raise ValueError("not an RSA public key") from None
    der = loaded.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def is_peer_id(text: str) -> bool:
    """Whether `text` reads as a base58 libp2p peer id (a multihash)."""
    try:
        multihash.decode(base58.b58decode(text))
    except Exception:
        return False
    return True


def own_peer_id(key: RSAPrivateKey) -> str:
    return peer_id_of(key.get_public_key().to_bytes())


@functools.lru_cache(maxsize=4096)
def public_key(data: bytes) -> RSAPublicKey:
    return RSAPublicKey.from_bytes(bytes(data))
