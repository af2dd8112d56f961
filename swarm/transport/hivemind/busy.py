"""Seconds a peer spent doing something (sending, holding micro-batches), however many at once.

Activities that overlap count their common time once, so a peer's sending seconds plus its idle
seconds never exceed the wall time: the step-time split its metrics show (`--metrics_port`).
Entered and left on one thread (the peer's event loop); `seconds` may be read from any thread.
"""

from __future__ import annotations

import contextlib
import time


class Busy:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.active = 0
        self._since = 0.0
        self._done = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = self.clock()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._done += self.clock() - self._since

    @contextlib.contextmanager
    def during(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @property
    def seconds(self) -> float:
        """Busy seconds so far, the activity going on now included."""
        since, active = self._since, self.active
        return self._done + (self.clock() - since if active else 0.0)
