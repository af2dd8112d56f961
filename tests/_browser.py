"""Drive Debian's headless Chromium over the Chrome DevTools Protocol, for tests (not a test module itself).

No dependencies: with --remote-debugging-pipe the browser reads commands on its fd 3 and writes replies and
events on its fd 4, each a JSON message terminated by a NUL byte. Usage:
`with Browser() as b: b.open(url); b.wait_for("document.title")`."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

HINT = "install it by hand: sudo apt-get install -y --no-install-recommends chromium"


@functools.cache
def ensure_chromium() -> str:
    """The path of Debian's chromium, installed with apt-get (as root) if it is not on PATH yet."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    if os.geteuid() != 0:
        raise RuntimeError(f"chromium is not on PATH and installing it needs root; {HINT}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]
    for cmd in (["apt-get", "update", "-qq"], install):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({exc}); {HINT}") from None
        if proc.returncode:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode} ({last}); {HINT}")
    if path := shutil.which("chromium") or shutil.which("chromium", path="/usr/bin"):
        return path
    raise RuntimeError(f"apt-get installed chromium but it is not on PATH; {HINT}")


class Browser:
    """A headless Chromium in its own session, driven over CDP; use as a context manager."""

    FLAGS = (
        "--headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run --no-default-browser-check"
        " --remote-debugging-pipe"
    ).split()

    def __init__(self, *extra_args: str, start_timeout: float = 30.0):
        self.extra_args = extra_args
        self.start_timeout = start_timeout
        self.session_id: str | None = None  # the page opened last; evaluate() runs there by default
        self.pid: int | None = None
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._cond = threading.Condition()
        self._next_id = 0
        self._eof = False

    def __enter__(self) -> Browser:
        self._dir = Path(tempfile.mkdtemp(prefix="hivepipe-chromium-"))
        self._log = self._dir / "stderr.log"
        try:
            self._start()
            self.send("Browser.getVersion", timeout=self.start_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        argv = [ensure_chromium(), *self.FLAGS, *self.extra_args, f"--user-data-dir={self._dir / 'profile'}"]
        argv.append("about:blank")
        cmd_r, self._cmd_w = os.pipe()  # the browser reads commands on its fd 3
        self._out_r, out_w = os.pipe()  # and writes replies and events on its fd 4
        # Move the child's ends above 4 so that dup2 onto 3 and 4 cannot clobber one with the other.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, out_w)]
        os.close(cmd_r)
        os.close(out_w)
        log = os.open(self._log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        actions += [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in ((1, log), (2, log), (3, high[0]), (4, high[1]))]
        try:  # setsid: its own session and process group, so that close() can kill every process of it
            self.pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setsid=True)
        except OSError:
            os.close(self._cmd_w)
            os.close(self._out_r)
            raise
        finally:
            for fd in (*high, log):
                os.close(fd)
        self._reader = threading.Thread(target=self._read, name="chromium-cdp-reader", daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Close the browser (Browser.close, then SIGKILL its process group) and remove its temp dir."""
        if self.pid is not None:
            if not self._eof and not self._exited():
                with contextlib.suppress(RuntimeError):
                    self.send("Browser.close", timeout=5)
            self._until(self._exited, 5)
            # Unreaped, the leader keeps its pgid from being reused: kill whatever of the group lingers.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._until(lambda: not self._group_alive(), 5)  # till init has reaped the orphaned children too
            self.pid = None
            os.close(self._cmd_w)
            self._reader.join(timeout=5)
            os.close(self._out_r)
        shutil.rmtree(self._dir, ignore_errors=True)

    @staticmethod
    def _until(condition, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _exited(self) -> bool:  # without reaping it
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def _group_alive(self) -> bool:
        try:
            return os.killpg(self.pid, 0) is None
        except ProcessLookupError:
            return False

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._out_r, 1 << 16):
            *messages, buf = (buf + chunk).split(b"\0")
            with self._cond:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"chromium: {what}; its stderr ends with:\n{self.stderr_tail()}")

    def send(self, method: str, params: dict | None = None, session_id: str | None = None, timeout: float = 10) -> dict:
        """Send one CDP command and return its result; RuntimeError on an error reply, a timeout or browser exit."""
        with self._cond:
            self._next_id = msg_id = self._next_id + 1
        msg = dict(id=msg_id, method=method, params=params or {}, **({"sessionId": session_id} if session_id else {}))
        data = json.dumps(msg).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._cmd_w, data) :]
        except OSError as exc:
            raise self._fail(f"cannot send {method} ({exc})") from None
        with self._cond:
            if not self._cond.wait_for(lambda: msg_id in self._replies or self._eof, timeout):
                raise self._fail(f"no reply to {method} within {timeout} s")
            if msg_id not in self._replies:
                raise self._fail(f"the browser exited before replying to {method}")
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise RuntimeError(f"{method} failed: {reply['error'].get('message')} {reply['error'].get('data', '')}")
        return reply.get("result", {})

    def open(self, url: str, timeout: float = 30.0) -> str:
        """Open `url` in a new tab, wait for its load event, and return the tab's CDP session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable"):
            self.send(method, session_id=session)
        self.send("Page.setLifecycleEventsEnabled", {"enabled": True}, session_id=session)
        with self._cond:
            seen = len(self._events)
        nav = self.send("Page.navigate", {"url": url}, session_id=session, timeout=timeout)
        if nav.get("errorText"):
            raise RuntimeError(f"Page.navigate to {url} failed: {nav['errorText']}")
        if nav.get("loaderId"):  # the "load" of this very navigation, not a late one of the initial about:blank
            self.wait_event("Page.lifecycleEvent", seen, session, timeout, name="load", loaderId=nav["loaderId"])
        self.session_id = session
        return session

    def wait_event(self, method: str, since: int = 0, session_id: str | None = None, timeout: float = 10, **params):
        """The first event `method` (of `session_id`, with these params) from the `since`-th event on."""

        def match() -> dict | None:
            events = (e for e in self._events[since:] if e["method"] == method and e.get("sessionId") == session_id)
            return next((e for e in events if params.items() <= e.get("params", {}).items()), None)

        with self._cond:
            if self._cond.wait_for(lambda: match() or self._eof, timeout) and (event := match()):
                return event
        raise self._fail(f"no {method} event {params or ''} within {timeout} s")

    def evaluate(self, expression: str, session_id: str | None = None):
        """The value of a JavaScript expression in the page (promises awaited); RuntimeError if it throws."""
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        result = self.send("Runtime.evaluate", params, session_id=session_id or self.session_id)
        if details := result.get("exceptionDetails"):
            exception = details.get("exception", {})
            described = exception.get("description") or exception.get("value") or ""
            raise RuntimeError(f"{expression!r} threw: {details.get('text', '')} {described}".strip())
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, interval: float = 0.25):
        """Poll `expression` till its value is truthy and return it, else AssertionError with the last value.
        An expression that throws counts as not true yet (the element may not exist yet)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as exc:
                if self._eof:
                    raise
                value = exc
            if value and not isinstance(value, Exception):
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"{expression!r} was not truthy within {timeout} s; last value: {value!r}")
            time.sleep(interval)
