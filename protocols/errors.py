"""The one exception a malformed payload raises."""


class PayloadError(ValueError):
    """A payload that cannot be trusted: wrong lengths, bad checksum, unknown codec, limits."""
