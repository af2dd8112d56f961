"""How fast a link delivers: bytes over the seconds payloads were arriving on it.

A payload's transfer runs from its stream's opening (the sender opens it when its send slot is
free, right before writing) to its last chunk. Transfers that overlap count their common time
once, so bytes / busy seconds is what the link carried while it was busy, shared with whatever
else crossed it: the bandwidth adaptive compression plans with.
"""

from __future__ import annotations


class LinkMeter:
    def __init__(self) -> None:
        self.nbytes = 0
        self.busy_s = 0.0
        self._until = float("-inf")  # end of the latest transfer counted

    def add(self, started: float, finished: float, nbytes: int) -> None:
        """One payload (monotonic seconds). Transfers are added as they finish, so only the part of
        this one after the latest finish so far is new busy time (gaps before it are not
        revisited: a slight undercount when transfers finish out of order)."""
        self.nbytes += nbytes
        new = finished - max(started, self._until)
        if new > 0:
            self.busy_s += new
        self._until = max(self._until, finished)
