"""The exceptions malformed input raises: a payload that cannot be trusted, a message that breaks
the stage protocol."""


class PayloadError(ValueError):
    """A payload that cannot be trusted: wrong lengths, bad checksum, unknown codec, limits."""


class ProtocolError(ValueError):
    """A message that breaks the stage protocol (truncated, corrupted, out of order, wrong kind)."""
