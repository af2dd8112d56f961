"""Seconds a peer spent doing something (sending, holding micro-batches), however many at once.

Activities that overlap count their common time once, so a peer's sending seconds plus its idle
seconds never exceed the wall time: the step-time split its metrics show (`--metrics_port`).
Entered and left on one thread at a time; `seconds` may be read from any thread (a metrics scrape):
the state is one tuple, replaced in one assignment, so a reader never sees half an update.
"""

from __future__ import annotations

import contextlib
import time


class Busy:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._state = (0.0, 0.0, 0)  # (seconds of finished busy spells, when the current one began, activities now)

    @property
    def active(self) -> int:
        return self._state[2]

    def enter(self) -> None:
        done, since, active = self._state
        self._state = (done, self.clock() if active == 0 else since, active + 1)

    def leave(self) -> None:
        done, since, active = self._state
        if active == 1:
            self._state = (done + self.clock() - since, since, 0)
        else:
            self._state = (done, since, active - 1)

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
        done, since, active = self._state
        return done + (self.clock() - since if active else 0.0)
