"""Choosing the peer that serves a stage, among the peers the run's owner admitted, skipping banned
ones, by one policy (`RoutingPolicy`: score, keeping a neighbour, spreading, announced throughput).

A peer that fails or times out is banned with exponential backoff (hivemind's `Blacklist`
policy, as Petals uses it); a success clears its record.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protocols.version import PROTOCOL_VERSION
from swarm.transport.hivemind.dht.announce import StageRecord, discover
from swarm.transport.hivemind.net.bans import Bans
from swarm.transport.hivemind.net.node import SwarmNode


class NoPeerError(RuntimeError):
    """No live, compatible, unbanned peer serves a stage."""


@dataclass(frozen=True)
class RoutingPolicy:
    """How a caller chooses the peer of a stage, in one place (its constants are settings:
    `route_keep_factor`, `throughput_smoothing`; docs/settings.md).

    - A peer's score is its expected share of the work: its announced throughput over one plus its
      announced queue and the micro-batches this caller awaits from it; a peer not measured yet (one
      that just joined) counts as the median of those measured, so it gets its share.
    - Micro-batches on a link whose codecs keep state (error feedback) follow one peer, kept unless
      another scores `keep_factor` times higher (its link state stays on the pair). Others go to the
      best score each time, which counts what the caller awaits of each peer: they spread over the
      replicas (a sender that kept its last peer piled its micro-batches on it while the others'
      records still showed old queues: docs/bench/scale.md).
    - The throughput a peer announces is a moving average of its micro-batches' samples/s, the
      newest weighing `smoothing`.
    """

    keep_factor: float = 2.0
    smoothing: float = 0.1

    @classmethod
    def of(cls, settings) -> RoutingPolicy:
        return cls(settings.routing.route_keep_factor, settings.routing.throughput_smoothing)

    @staticmethod
    def score(record: StageRecord, typical: float = 1.0, waiting: int = 0) -> float:
        """Expected share of work a peer can take (`typical`: the throughput of one not measured yet)."""
        return (record.throughput or typical) / (1 + record.queue + waiting)

    def pick(
        self, candidates: list[StageRecord], sticky: str | None, waiting: Mapping[str, int] | None, rng: random.Random
    ) -> StageRecord:
        measured = sorted(r.throughput for r in candidates if r.throughput > 0)
        typical = measured[len(measured) // 2] if measured else 1.0
        scores = {r.peer_id: self.score(r, typical, (waiting or {}).get(r.peer_id, 0)) for r in candidates}
        best = max(candidates, key=lambda r: (scores[r.peer_id], rng.random()))
        for record in candidates:
            if record.peer_id == sticky and self.keep_factor * scores[record.peer_id] >= scores[best.peer_id]:
                return record
        return best

    @staticmethod
    def awaited(stateful: bool, waiting: Mapping[str, int]) -> Mapping[str, int] | None:
        """What a caller weighs peers by beyond their records: nothing on a stateful link (it keeps
        to one peer while that one is not much slower), else the micro-batches it awaits of each."""
        return None if stateful else waiting

    def throughput(self, previous: float, rate: float) -> float:
        """The samples/s a peer announces after a micro-batch that ran at `rate`."""
        return rate if previous == 0 else (1 - self.smoothing) * previous + self.smoothing * rate


class Router:
    """Cached DHT view of a run's stages, refreshed every `refresh_s` or on demand (defaults: the
    node's settings, lookup_every_s and lookup_keep_s)."""

    def __init__(
        self,
        node: SwarmNode,
        run_id: str,
        routable: Callable[[StageRecord], bool] | None = None,
        visible: Callable[[StageRecord], bool] | None = None,
        refresh_s: float | None = None,
        seed: int | None = None,
        keep_s: float | None = None,
    ) -> None:
        settings = node.settings
        self.node = node
        self.run_id = run_id
        # whether the run's owner admitted a record's peer (swarm.transport.hivemind.trust): anyone
        # can announce itself on the DHT, only admitted peers are handed micro-batches
        self.routable = routable or (lambda record: True)
        self.visible = visible or (lambda record: True)  # the peers it may know of at all (a private run's)
        # the owner's verifiers (train.verifiers): chosen only when no other peer may be
        self.standby: Callable[[StageRecord], bool] = lambda record: False
        self.refresh_s = settings.dht.lookup_every_s if refresh_s is None else refresh_s
        self.keep_s = settings.dht.lookup_keep_s if keep_s is None else keep_s
        self.policy = RoutingPolicy.of(settings)
        self.bans = Bans(settings.retries.ban_s, settings.retries.ban_growth, settings.retries.ban_max_s)
        self.events = None  # a swarm.transport.hivemind.net.events.EventLog its bans go to
        self.banned_total = 0  # bans so far (metrics)
        self._cache: dict[int, tuple[float, list[StageRecord]]] = {}
        self._found: dict[int, tuple[float, list[StageRecord]]] = {}  # the last lookup that found someone
        self._random = random.Random(seed)

    async def peers(self, stage: int, refresh: bool = False) -> list[StageRecord]:
        """The stage's peers, looked up again after `refresh_s`. A lookup that finds nobody keeps the
        last non-empty answer for `keep_s`: over a saturated slow link the DHT's requests can time
        out while the peers serve on (a dead one is found out by its call failing, and banned)."""
        cached = self._cache.get(stage)
        if refresh or cached is None or time.monotonic() - cached[0] > self.refresh_s or not cached[1]:
            now = time.monotonic()
            found = await discover(self.node, self.run_id, stage)
            records = [r for r in found if r.version == PROTOCOL_VERSION and self.visible(r)]
            if records:
                self._found[stage] = (now, records)
            elif stage in self._found and now - self._found[stage][0] <= self.keep_s:
                records = self._found[stage][1]
            self._cache[stage] = (now, records)
        return self._cache[stage][1]

    async def choose(
        self,
        stage: int,
        exclude=(),
        sticky: str | None = None,
        session: str | None = None,
        waiting: Mapping[str, int] | None = None,
    ) -> StageRecord:
        """The best ready peer for `stage` (set up by `session`, when given): `sticky` if it is still
        usable, else by score; `waiting`: peer -> micro-batches the caller awaits from it. When every
        usable peer is banned, the one whose ban ends first: a ban steers work to the stage's other
        peers, and without one a stage's only peer is tried again (one failed dial, a daemon's
        hiccup, must not end the run; a dead peer fails again at once, and the trainer's recovery
        finds it gone)."""
        usable: list[StageRecord] = []
        for refresh in (False, True):
            records = await self.peers(stage, refresh)
            usable = [
                r
                for r in records
                if r.peer_id not in exclude and r.ready and session in (None, r.session) and self.routable(r)
            ]
            usable = [r for r in usable if not self.standby(r)] or usable
            candidates = [r for r in usable if not self.bans.banned(r.peer_id)]
            if candidates:
                break
        else:
            if not usable:
                raise NoPeerError(f"no live peer serves stage {stage} of run {self.run_id!r}")
            candidates = [min(usable, key=lambda r: self.bans.until.get(r.peer_id, 0.0))]
        return self.policy.pick(candidates, sticky, waiting, self._random)

    def failed(self, peer_id: str) -> float:
        """Stops routing to `peer_id` for a while (longer each time it fails); the ban's seconds."""
        seconds = self.bans.fail(peer_id)
        self.banned_total += 1
        if self.events is not None:
            self.events.add("ban", f"peer {peer_id[-8:]} failed: not routed to for {seconds:.0f}s")
        return seconds

    def succeeded(self, peer_id: str) -> None:
        self.bans.succeed(peer_id)
