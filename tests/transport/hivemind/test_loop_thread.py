"""The background event loop (swarm.transport.hivemind.net.loop) that synchronous code waits on."""

from __future__ import annotations

import subprocess
import sys

from _util import REPO

# The kernel hands a process's signal to any of its threads; this sends Ctrl-C to the loop's thread
# on purpose, while the main thread waits on the loop for a minute.
WAITER = """
import asyncio, signal, threading, time
from swarm.transport.hivemind.net.loop import LoopThread

# Python's own Ctrl-C, whatever was inherited: a test run started in the background of a
# non-interactive shell ignores SIGINT, and so would this process
signal.signal(signal.SIGINT, signal.default_int_handler)
loop = LoopThread()
threading.Timer(0.5, signal.pthread_kill, (loop._thread.ident, signal.SIGINT)).start()
started = time.monotonic()
try:
    loop.run(asyncio.sleep(60))
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - started:.1f}s")
print(loop.run(asyncio.sleep(0, "the loop runs on")))
"""


def test_ctrl_c_reaches_a_main_thread_waiting_on_the_loop_whichever_thread_got_it():
    out = subprocess.run([sys.executable, "-c", WAITER], capture_output=True, text=True, timeout=120, cwd=REPO)
    first, second = out.stdout.splitlines()
    assert out.returncode == 0 and first.startswith("interrupted after "), out.stdout + out.stderr
    assert float(first.split()[-1].rstrip("s")) < 30  # not the minute the wait would have taken
    assert second == "the loop runs on"
