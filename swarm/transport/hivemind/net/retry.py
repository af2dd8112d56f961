"""The transport's one retry policy: which failures are worth another try, how often, how soon.

- A micro-batch whose peer died or timed out (`TransportError`) is tried again on another peer of
  the same stage, the failed one banned for a while (`net.bans.Bans`); one whose link lost its order
  or state (`RemoteError` with LINK_RESET) is tried again on the same peer, on a new link epoch;
  one whose peer does not serve it now (NOT_READY, UNAVAILABLE: joining, leaving, at another step)
  on another peer, like a dead one; one whose chain lost a later stage's peer past its budget
  (DOWNSTREAM) on the same peer, which routes elsewhere now. Other error replies are final (a bad config, a bad payload: trying again would say the same).
- A step round or a setup is idempotent on the peer, so a lost reply is simply retried on the same
  peer, after a growing backoff.
Either way a call is tried at most `Settings.retries.attempts` times, and never past its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from protocols.errors import RemoteError, TransportError
from swarm.transport.hivemind.net.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


class Retry:
    def __init__(self, settings: Settings) -> None:
        self.attempts, self.backoff_s = settings.retries.attempts, settings.retries.backoff_s
        self.retries = 0  # calls tried again by same_peer (metrics)

    def again(self, error: Exception, attempt: int, deadline: float | None = None) -> bool:
        """Whether a call that failed with `error` on its `attempt`-th try (from 0) is tried again."""
        if isinstance(error, RemoteError) and not (error.retry_link or error.other_peer or error.downstream):
            return False
        if not isinstance(error, TransportError | RemoteError):
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        return attempt + 1 < self.attempts

    async def same_peer(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """`attempt()` until it succeeds; a `TransportError` is retried after `backoff_s` times the
        attempts so far (the call must be idempotent), anything else is raised at once."""
        for n in range(self.attempts):
            try:
                return await attempt()
            except TransportError as e:
                if n + 1 == self.attempts:
                    raise
                log.warning("%s failed (%s); retrying", what, e)
                self.retries += 1
                await asyncio.sleep(self.backoff_s * (n + 1))
        raise AssertionError("unreachable")
