"""crc32 (zlib's polynomial, zlib's values) as fast as this machine allows.

Every payload is checksummed by its sender and checked by its receiver, at each hop, so the
checksum's speed counts: ISA-L's (the `isal` package: carry-less multiply) is several times
zlib's (docs/bench/README.md, "The payload path") and gives the same values, so the wire format
does not depend on which one a peer has.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels: the same values, slower
    from zlib import crc32

__all__ = ["crc32"]
