"""A timeline of what one process did, as Chrome trace events (the JSON that Perfetto and
chrome://tracing open): spans of computing, encoding, sending, receiving and waiting, per
micro-batch, on named tracks, in wall-clock microseconds.

Off unless a process starts it (`start`, from a peer's `--trace`): every `span` is then a no-op
costing one attribute read. Spans may come from any thread (the event loop, the computing
thread); each is appended whole. `write` saves the process's trace, with the exchanges it timed as
caller or callee (`exchange`): `swarm.trace_merge` aligns several processes' clocks from those.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

_EPOCH_OFFSET = time.time() - time.monotonic()  # monotonic -> wall seconds, taken once


def wall(monotonic_s: float) -> float:
    """A `time.monotonic()` reading as wall-clock seconds (the transport times with monotonic)."""
    return _EPOCH_OFFSET + monotonic_s


class Tracer:
    def __init__(self) -> None:
        self.enabled = False
        self.process = ""
        self._events: list[dict] = []
        self._tracks: dict[str, int] = {}
        self._exchanges: list[dict] = []
        self._lock = threading.Lock()

    def start(self, process: str) -> None:
        """Records from now on; `process`: the name the timeline shows (e.g. "stage1 …a3f9")."""
        self.enabled, self.process = True, process

    def _track(self, track: str) -> int:
        with self._lock:
            return self._tracks.setdefault(track, len(self._tracks) + 1)

    def add(self, name: str, track: str, start_s: float, end_s: float, **args) -> None:
        """A span of wall-clock seconds [start_s, end_s] on `track`."""
        if not self.enabled:
            return
        event = {
            "name": name,
            "cat": track.split(" ", 1)[0],
            "ph": "X",
            "ts": start_s * 1e6,
            "dur": max(end_s - start_s, 0.0) * 1e6,
            "tid": self._track(track),
        }
        if args:
            event["args"] = args
        self._events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, track: str, **args):
        """The time the block takes, as a span (nothing when tracing is off)."""
        if not self.enabled:
            yield
            return
        started = time.time()
        try:
            yield
        finally:
            self.add(name, track, started, time.time(), **args)

    def exchange(self, role: str, peer: str, key: str, sent_s: float, replied_s: float) -> None:
        """One request-reply exchange with `peer` about `key`: as "caller", when the request began
        to leave and when the reply began to arrive; as "callee", when the request began to arrive
        and when the reply began to leave. Pairs of the two sides give the clocks' offset (NTP's
        estimate: a one-way delay added where a message is sent shows on both ways alike)."""
        if self.enabled:
            self._exchanges.append({"role": role, "peer": peer, "key": key, "t0": sent_s, "t1": replied_s})

    def trace(self, peer_id: str = "") -> dict:
        """The Chrome trace of this process (pid: this process's id)."""
        pid = os.getpid()
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": self.process}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
            for track, tid in self._tracks.items()
        ]
        events = [{**event, "pid": pid} for event in list(self._events)]
        return {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {"process": self.process, "peer_id": peer_id, "exchanges": list(self._exchanges)},
        }

    def write(self, path: str | Path, peer_id: str = "") -> None:
        if self.enabled:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.trace(peer_id)))


TRACER = Tracer()  # the process's one tracer: off until a peer with --trace starts it
