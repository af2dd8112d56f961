"""Protobuf fields written and found by hand, for messages whose large buffers are not to be copied.

A length-delimited field is `tag, length, content`; writing its content as separate segments lets
the caller join them once (wire.encode) or write them to a socket as they are (framing.frame_parts).
Protobuf writes fields in number order, so a message whose small fields go through protobuf and
whose buffer fields follow here, in that order, is what protobuf itself would write. Reading,
`trailing_field` finds such a last field, so that the rest is parsed by protobuf and the buffer
stays a view of what was received (framing.parse_message).
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


def _varint_at(buf, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`; ValueError when it runs past the end or over 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("truncated or overlong varint")


_SKIP = {1: 8, 5: 4}  # fixed64, fixed32: bytes after the key


def trailing_field(buf: memoryview, number: int) -> tuple[int, int] | None:
    """(where its tag starts, where its content starts) when the last field of the serialized
    message `buf` is field `number`, length-delimited, and ends exactly where `buf` does; None
    otherwise (a malformed message included: protobuf then parses it whole, in native code, and
    says what is wrong).

    It reads one key per field, skipping every field's content by its length, and stops at the
    first key no message of ours has: field number 0, a wire type other than varint, fixed64,
    length-delimited or fixed32, a field whose number is not above the one before (protobuf writes
    each field of ours once, in number order, and `number` is the last), or a length past the end.
    So a well-formed message costs at most `number` keys, whatever its size: read on, zero bytes
    (field 0, varint 0) cost one Python iteration per two bytes, 2.3 s for a stranger's 2 MiB."""
    pos, previous, last = 0, 0, None
    try:
        while pos < len(buf):
            start = pos
            key, pos = _varint_at(buf, pos)
            field, kind, content = key >> 3, key & 7, None
            if not previous < field <= number:
                return None
            if kind == 0:
                pos = _varint_at(buf, pos)[1]
            elif kind == 2:
                length, pos = _varint_at(buf, pos)
                content, pos = pos, pos + length
            elif kind in _SKIP:
                pos += _SKIP[kind]
            else:
                return None
            if pos > len(buf):
                return None
            previous, last = field, (start, content)
    except ValueError:
        return None
    if previous != number or last[1] is None:
        return None
    return last
