"""The event loops peers run on: uvloop where installed, and a background loop so synchronous code
(`swarm.training.loop.train`, CLIs, tests) can drive hivemind's asyncio-only P2P.

uvloop does a stream's socket reads and writes in C (libuv). Against asyncio's selector loop its
gain in the throughput benchmark was within the run-to-run noise (docs/bench/README.md, "The
payload path"); it is kept because the peers' event loops are mostly that socket traffic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any

try:
    from uvloop import new_event_loop
except ImportError:  # Windows: asyncio's own loop
    new_event_loop = asyncio.new_event_loop

WAKE_S = 0.2  # how often the main thread wakes while it waits on the loop, to run signal handlers


def run(coro: Coroutine) -> Any:
    """asyncio.run, on the fastest loop this platform has."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


class LoopThread:
    def __init__(self, name: str = "hivepipe-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Runs `coro` on the loop and waits for its result (raises its exception). Ctrl-C and
        SIGTERM reach the waiting main thread within WAKE_S, and cancel `coro`."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        if threading.current_thread() is not threading.main_thread():
            return future.result(timeout)
        # The kernel may hand a process's signal to any of its threads: to this loop's, say. Python
        # then runs its handler only once the main thread executes bytecode, which a blocking wait
        # for `future` never does: a trainer waiting for stage peers ignored Ctrl-C for minutes.
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not future.done():
                left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"no result within {timeout}s")
                concurrent.futures.wait([future], timeout=left)
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def stop(self) -> None:
        """Cancels what is still pending (background refreshes), then stops the loop."""
        if self.loop.is_closed():
            return

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_rest(), timeout=10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
