"""A stage's training compute: wall seconds, the computing thread's CPU seconds, and samples.

The wall time bounds a pipeline by its slowest stage; the CPU time is what a machine's cores must
give when several stages share them (swarm.bench.bounds.shared_cores_bound): time spent waiting
for a core is not work. `start` and `stop` run on the computing thread, whose CPU time they read.
"""

from __future__ import annotations

import time


class ComputeClock:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.samples = 0

    @staticmethod
    def start() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def stop(self, started: tuple[float, float], samples: int = 0) -> None:
        """Counts the time since `started` (from `start`, on this thread) and `samples` more samples."""
        self.seconds += time.perf_counter() - started[0]
        self.cpu_seconds += time.thread_time() - started[1]
        self.samples += samples
