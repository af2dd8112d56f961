"""Peers banned for a while, longer each time (hivemind's `Blacklist` policy, as Petals uses it):
a caller's bans of the peers that failed it (routing.router) and a server's of the senders it
refuses (stage.refusals) are the same kind of table, so both sides take it from here."""

from __future__ import annotations

import time


class Bans:
    def __init__(self, base_s: float, growth: float, max_s: float) -> None:
        self.base_s, self.growth, self.max_s = base_s, growth, max_s
        self.until: dict[str, float] = {}
        self.failures: dict[str, int] = {}

    def fail(self, peer_id: str) -> float:
        n = self.failures.get(peer_id, 0)
        duration = min(self.base_s * self.growth**n, self.max_s)
        self.until[peer_id] = time.monotonic() + duration
        self.failures[peer_id] = n + 1
        return duration

    def succeed(self, peer_id: str) -> None:
        self.until.pop(peer_id, None)
        self.failures.pop(peer_id, None)

    def banned(self, peer_id: str) -> bool:
        return self.until.get(peer_id, 0.0) > time.monotonic()

    def prune(self, keep: int = 4096) -> None:
        """Forgets peers whose ban ran out, once there are more than `keep` (a table many peer ids fill)."""
        if len(self.until) > keep:
            now = time.monotonic()
            for peer_id in [p for p, until in self.until.items() if until <= now]:
                self.until.pop(peer_id)
                self.failures.pop(peer_id, None)
