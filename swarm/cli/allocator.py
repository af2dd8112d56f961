"""Keep freed large blocks in the process heap (glibc), so per-micro-batch tensors reuse memory.

By default glibc returns every block above 128 KiB to the kernel when it is freed; the next
tensor of the same size then pays page faults and zeroing again, which slows every micro-batch
and makes timings erratic. Raising the mmap and trim thresholds keeps those pages.
A no-op on other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def keep_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """Apply once per process; returns whether glibc accepted it."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, min(limit_bytes, 1 << 30))) and bool(
        mallopt(_M_TRIM_THRESHOLD, limit_bytes)
    )
    return _applied
