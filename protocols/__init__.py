"""The wire: what crosses a link, byte for byte.

`message` holds the in-memory parts a codec produces, `wire` turns them into the bytes of a
`CompressedTensor` (compressed_tensor.proto) and back, validating everything it reads.
"""

from protocols.errors import PayloadError
from protocols.message import (
    Encoded,
    Granularity,
    LowRankPart,
    QuantPart,
    RawPart,
    SparsePart,
    StateStamp,
    SubspacePart,
)
from protocols.version import PROTOCOL_VERSION
from protocols.wire import DecodeLimits, decode, encode

__all__ = [
    "DecodeLimits",
    "Encoded",
    "PROTOCOL_VERSION",
    "Granularity",
    "LowRankPart",
    "PayloadError",
    "QuantPart",
    "RawPart",
    "SparsePart",
    "StateStamp",
    "SubspacePart",
    "decode",
    "encode",
]
