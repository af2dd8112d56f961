"""What every hivepipe DHT node checks of the records it stores and reads (hivemind's validators).

- `RSASignatureValidator`: a record whose key or subkey holds `[owner:KEY]` must be signed by that
  key: a stage peer's record, its entry in the run listing, the owner's config record.
- `SchemaValidator`: the run listing (a key every node knows) must be `{run id + owner: {"num_stages":
  n >= 1}}`, signed. Records of one run have keys of their own, which nodes outside the run cannot
  know; their readers check them (`announce.StageRecord.from_value`, `runconfig.PublishedConfig`).
"""

from __future__ import annotations

from typing import Dict  # noqa: UP035 (pydantic v1 reads typing's generics)

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarm.transport.hivemind.trust.keys import peer_id_of

RUNS_PREFIX = "hivepipe"
RUNS_KEY = f"{RUNS_PREFIX}_runs"  # subkey per (run id, lister's key): {"num_stages": n}, so status can list runs


class RunListing(pydantic.BaseModel):
    num_stages: pydantic.conint(ge=1, strict=True)

    class Config:
        extra = pydantic.Extra.forbid


class Listings(pydantic.BaseModel):
    runs: Dict[bytes, RunListing]  # noqa: UP006


def owned(subkey) -> tuple[bytes, str] | None:
    """A subkey `prefix[owner:KEY]` (what RSASignatureValidator checks) as (prefix, the key's peer
    id); None for any other subkey."""
    if not isinstance(subkey, bytes) or not subkey.endswith(b"]"):
        return None
    prefix, marker, key = subkey.partition(b"[owner:")
    try:
        return (prefix, peer_id_of(key[:-1])) if marker else None
    except ValueError:
        return None


def validators(key: RSAPrivateKey) -> CompositeValidator:
    """The validators of a node that signs its records with `key`."""
    return CompositeValidator([RSASignatureValidator(key), SchemaValidator(Listings, prefix=RUNS_PREFIX)])
