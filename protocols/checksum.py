"""crc32 (zlib's polynomial, zlib's values) as fast as this machine allows.

Every payload is checksummed by its sender and checked by its receiver, at each hop; zlib's crc32
runs ~5 GB/s here, ISA-L's (the `isal` package: carry-less multiply) ~27 GB/s with the same
values, so the wire format does not depend on which one a peer has.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels: the same values, slower
    from zlib import crc32

__all__ = ["crc32"]
