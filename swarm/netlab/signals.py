"""Signals while a lab is up, so that no way of stopping its owner leaves namespaces behind.

SIGTERM and SIGHUP (and SIGINT when Python's own Ctrl-C handler is not installed) raise
NetlabInterrupted, a KeyboardInterrupt, so the stack unwinds through the lab's teardown as code
that already stops cleanly on Ctrl-C does. A signal that arrives during teardown is held until
teardown is done. Then each signal is handed on to what was installed before: a Python handler is
called, and the default disposition is re-delivered, so the process still ends "killed by SIGTERM".
A signal the process ignores stays ignored.

    relay = SignalRelay(); relay.install()      # main thread only; elsewhere it does nothing
    relay.hold(); ...teardown...; relay.release()
    pass_on(exc)                                 # after teardown, for a NetlabInterrupted caught
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from swarm.netlab.kernel import NetlabInterrupted


class SignalRelay:
    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._holding = False
        self._pending: int | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # Python allows handlers there only
            return
        candidates = [signal.SIGTERM, signal.SIGHUP]
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # otherwise Python's KeyboardInterrupt already unwinds
            candidates.append(signal.SIGINT)
        for sig in candidates:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python: leave it be
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)

    def hold(self) -> None:
        """From now on a signal waits for `release()`: teardown must not be cut short."""
        self._holding = True

    def release(self) -> None:
        """Puts back the handlers that were there before; a signal held meanwhile is handed on."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, handler)
        pending, self._pending = self._pending, None
        if pending is not None:
            pass_on(NetlabInterrupted(pending, previous.get(pending, signal.SIG_DFL)))

    def _on_signal(self, signum: int, frame) -> None:
        if self._holding:
            self._pending = signum
            return
        raise NetlabInterrupted(signum, self._previous.get(signum, signal.SIG_DFL))


def pass_on(exc: NetlabInterrupted) -> None:
    """After teardown: give the signal to what was installed before (or die of it, as without us)."""
    previous = exc.previous
    if callable(previous) and previous is not signal.default_int_handler:
        previous(exc.signum, None)
    elif previous is signal.SIG_DFL:
        signal.signal(exc.signum, signal.SIG_DFL)
        os.kill(os.getpid(), exc.signum)
        time.sleep(1.0)  # the signal is delivered asynchronously; if it was blocked, fall through
