"""What can go wrong in an exchange between peers: malformed input (a payload that cannot be trusted,
a message that breaks the stage protocol), a peer's error reply, a peer that did not answer; and
errors as one line."""

from __future__ import annotations

from protocols import stage_pb2 as pb


class PayloadError(ValueError):
    """A payload that cannot be trusted: wrong lengths, bad checksum, unknown codec, limits."""


class ProtocolError(ValueError):
    """A message that breaks the stage protocol (truncated, corrupted, out of order, wrong kind)."""


class MalformedMessage(ProtocolError):
    """Bytes no peer speaking the protocol writes: a message that does not parse, or breaks the
    layout every message has (a head first, then chunks; a marker, then a length within the limit).
    A slow or broken link truncates a stream, it never makes these: their sender is to blame, and is
    banned for a while (swarm.transport.hivemind.stage.server)."""


class RemoteError(RuntimeError):
    """The peer answered, with an error reply (it keeps serving); `code` says what may help."""

    def __init__(self, message: str, code: int = pb.ERROR_UNSPECIFIED, blamed=(), stale=()) -> None:
        super().__init__(message)
        self.code = code
        self.blamed = list(blamed)  # GROUP_FAILED: the group members the failure is on
        self.stale = list(stale)  # STALE: pb.StaleMicroBatch, the micro-batches to run again

    @property
    def retry_link(self) -> bool:
        return self.code == pb.LINK_RESET

    @property
    def downstream(self) -> bool:
        """A peer further down the chain did not answer: this one is fine and may be tried again."""
        return self.code == pb.DOWNSTREAM

    @property
    def other_peer(self) -> bool:
        """The peer does not serve this now (not set up, joining, leaving, at another step):
        another peer of its stage may."""
        return self.code in (pb.NOT_READY, pb.UNAVAILABLE)


class Replied(RemoteError):
    """An error reply as its caller received it: another peer's word, never a fault of whoever
    sent the caller the request it was serving (a stage relays its downstream's errors)."""


class SenderFault(RemoteError):
    """The request's own payload is malformed (it passed its checksum, not its decoding): its sender
    is to blame, and is banned for a while (swarm.transport.hivemind.stage.server)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed payload: {reason}")


class TransportError(RuntimeError):
    """The peer did not answer properly: unreachable, died, timed out or sent a broken reply."""


def one_line(e: BaseException, limit: int = 500) -> str:
    """An error as one line: our own errors by their message, others with their type."""
    text = str(e).strip()
    text = text.splitlines()[0] if text else ""
    if isinstance(e, RemoteError | ProtocolError) and text:
        return text[:limit]
    return f"{type(e).__name__}: {text}"[:limit] if text else type(e).__name__


def short(e: BaseException) -> str:
    """The first line of an error's message (its type when it has none), for messages of our own."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]
