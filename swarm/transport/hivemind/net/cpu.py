"""What a request costs this peer in CPU, and a budget per sender for the requests it refuses.

A stranger's bytes are cheap to send; refusing them must stay cheap. The stage server measures
every request it serves (`RequestCpu`): the thread CPU time of each step of its coroutine on the
event loop's thread, and of what it has computed on other threads (`charged`: a stage's computing
thread decoding its payload). A refused request's seconds go to its sender's `RefusalBudget`: a
sender whose refusals cost more than `share` of a core, over `window_s`, is banned like a sender of
a malformed payload (settings `limits.refusal_cpu_share`, `limits.refusal_cpu_window_s`).
"""

from __future__ import annotations

import contextvars
import time
import types
from collections import Counter
from collections.abc import Callable, Coroutine

_CURRENT: contextvars.ContextVar[RequestCpu | None] = contextvars.ContextVar("hivepipe_request_cpu", default=None)


class RequestCpu:
    """The CPU seconds one request has cost so far: on the event loop's thread, and elsewhere
    (each written by its own threads: no update is lost)."""

    def __init__(self) -> None:
        self.loop_s = 0.0
        self.other_s = 0.0

    @property
    def seconds(self) -> float:
        return self.loop_s + self.other_s

    async def run(self, coro: Coroutine):
        """Awaits `coro`, counting the thread CPU time of each of its steps; what it submits to
        other threads through `charged` meanwhile counts too."""
        token = _CURRENT.set(self)
        try:
            return await _metered(coro, self)
        finally:
            _CURRENT.reset(token)


@types.coroutine
def _metered(coro: Coroutine, cpu: RequestCpu):
    """`coro`, stepped as the event loop steps it, each step's thread CPU time added to `cpu`."""
    value, error = None, None
    while True:
        started = time.thread_time()
        try:
            signal = coro.throw(error) if error is not None else coro.send(value)
        except StopIteration as done:
            return done.value
        finally:
            cpu.loop_s += time.thread_time() - started
        try:
            value, error = (yield signal), None
        except BaseException as e:  # a cancellation, or the loop closing us: the coroutine handles it
            value, error = None, e


def charged(fn: Callable) -> Callable:
    """`fn`, to be run on another thread: its thread CPU time counts toward the request being
    served where it is submitted (none: `fn` as it is)."""
    cpu = _CURRENT.get()
    if cpu is None:
        return fn

    def run(*args):
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            cpu.other_s += time.thread_time() - started

    return run


class RefusalBudget:
    """The CPU a sender's refused requests may cost: `share` of a core, over any `window_s` (a
    bucket of `share * window_s` seconds that refills at `share` seconds per second). `spent`
    keeps the CPU seconds of every request of each sender, refused or not (its status)."""

    def __init__(self, share: float, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self.window_s, self.clock = share, window_s, clock
        self._left: dict[str, tuple[float, float]] = {}  # sender -> (seconds left, when)
        self.spent: Counter = Counter()
        self.refused_s = 0.0  # refusals of every sender, all told

    def served(self, sender: str, seconds: float) -> None:
        self.spent[sender] += seconds

    def refused(self, sender: str, seconds: float) -> bool:
        """Counts a refused request's seconds; True when its sender is over its budget now."""
        self.refused_s += seconds
        now, full = self.clock(), self.share * self.window_s
        left, since = self._left.get(sender, (full, now))
        left = min(full, left + (now - since) * self.share) - seconds
        self._left[sender] = (left, now)
        self._prune(now)
        return left < 0

    def _prune(self, now: float, keep: int = 4096) -> None:
        """Forgets senders whose budget has refilled, once there are more than `keep` (many peer ids)."""
        if len(self._left) > keep:
            full = self.share * self.window_s
            for sender in [s for s, (left, since) in self._left.items() if left + (now - since) * self.share >= full]:
                del self._left[sender]
        if len(self.spent) > keep:
            for sender, _ in self.spent.most_common()[keep // 2 :]:
                del self.spent[sender]
