"""What happened to a peer, for people: joins, leaves, bans, pauses, refusals, codec switches.

Each peer keeps its recent events (a bounded list: a long run or a hostile caller cannot grow it)
and counts every event by kind for as long as it runs. A stage peer shows its events in its status
(`peers.status`, the health page), a trainer in the progress record it publishes; both count them
in their metrics (`--metrics_port`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass

from protocols import stage_pb2 as pb

KINDS = ("join", "leave", "ban", "pause", "resume", "refuse", "codec", "setup", "other")
KEEP = 50  # recent events kept per peer
TEXT_CHARS = 200  # an event's text is one line of at most this many characters


@dataclass(frozen=True)
class Event:
    time: float  # seconds since the epoch
    kind: str
    text: str

    def to_pb(self) -> pb.Event:
        return pb.Event(time=self.time, kind=self.kind, text=self.text)

    @classmethod
    def of(cls, time_s, kind, text) -> Event | None:
        """An event read from another peer (a status reply, a DHT record): None unless well-formed."""
        if isinstance(time_s, bool) or not isinstance(time_s, int | float) or not math.isfinite(time_s):
            return None
        if not isinstance(kind, str) or not isinstance(text, str):
            return None
        return cls(float(time_s), kind if kind in KINDS else "other", _line(text))


def _line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= TEXT_CHARS else line[: TEXT_CHARS - 3] + "..."


class EventLog:
    def __init__(self, keep: int = KEEP, clock=time.time) -> None:
        self.recent: deque[Event] = deque(maxlen=keep)
        self.counts: Counter = Counter(
            dict.fromkeys(KINDS, 0)
        )  # kind -> events since the peer started (every kind, from 0)
        self.clock = clock

    def add(self, kind: str, text: str, level: int | None = None, logger: logging.Logger | None = None) -> Event:
        """Records an event (and logs its text at `level` to `logger`, when given)."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r} (one of {', '.join(KINDS)})")
        event = Event(self.clock(), kind, _line(text))
        self.recent.append(event)
        self.counts[kind] += 1
        if logger is not None:
            logger.log(logging.INFO if level is None else level, "%s", event.text)
        return event

    def last(self, n: int = KEEP) -> list[Event]:
        """The newest `n` events, oldest first."""
        events = list(self.recent)  # a copy: another thread (a metrics scrape) may read while we add
        return events[-n:] if n else []
