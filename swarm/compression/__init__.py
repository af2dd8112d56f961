"""Compression: codecs (math), error feedback (state), and the spec grammar.

The bytes of every payload are produced by `protocols.wire`; every figure the project reports
is the length of those bytes.
"""

from swarm.compression.codecs import Cast, Codec, Quantize, TopK, TopKReuse
from swarm.compression.feedback import Incoming, Outgoing, Receiver, Sender, StateMismatchError
from swarm.compression.spec import CompressionSpec, SpecError, parse
from swarm.compression.state import GlobalState, SampleStore, StaleStateError, StoreFullError

__all__ = [
    "Cast",
    "Codec",
    "CompressionSpec",
    "GlobalState",
    "Incoming",
    "Outgoing",
    "Quantize",
    "Receiver",
    "SampleStore",
    "Sender",
    "SpecError",
    "StaleStateError",
    "StateMismatchError",
    "StoreFullError",
    "TopK",
    "TopKReuse",
    "parse",
]
