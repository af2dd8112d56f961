"""Protobuf fields written by hand, for messages whose large buffers are not to be copied.

A length-delimited field is `tag, length, content`; writing its content as separate segments lets
the caller join them once (wire.encode) or write them to a socket as they are (chunks.frame_parts).
Protobuf writes fields in number order, so a message whose small fields go through protobuf and
whose buffer fields follow here, in that order, is what protobuf itself would write.
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    """`n` >= 0 as a protobuf varint (LEB128)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_delimited(number: int, segments: list) -> list:
    """Field `number` (a submessage or bytes) whose content is `segments`, as segments."""
    return [varint(number << 3 | 2) + varint(sum(len(s) for s in segments)), *segments]


def bytes_field(number: int, data) -> list:
    """A proto3 bytes field, as segments; an empty one is left out, as protobuf does."""
    return length_delimited(number, [data]) if len(data) else []
