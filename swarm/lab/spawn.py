"""Peer processes forked from one interpreter that has already imported torch and hivemind.

`python -m peers.stage` spends seconds of CPU importing torch and hivemind before it does anything
(about 2 s on an idle core; a lab starts four to nine peers, most of them at once, and a churn's
joiners and restarts one after another). The lab starts this module once (`Spawner`), it imports
what every peer imports and then forks a child per peer: the child is a separate process in its
own session (its p2p daemon in its group), in its namespace if the lab has them, with the lab's
environment and a pipe for its output, and runs the peer's module as `python -m` would
(`runpy`, as `__main__`; at its end, what the interpreter does but tearing the modules down).
Children are not the lab's
own: this process reaps them and says how each ended, which `SpawnedProcess` (a `subprocess.Popen`)
reads, so the lab follows, signals and waits for them as for any other.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

from swarm.netlab.kernel import pid_alive

PRELOAD = ("peers.stage", "peers.trainer", "peers.bootstrap")  # their imports: torch, hivemind, swarm
_CLONE_NEWNET = 0x40000000
_MESSAGE = 1 << 20


_shared: Spawner | None = None


def shared_spawner() -> Spawner:
    """This process's spawner, started at the first call: a benchmark's lab runs one after another
    share it (its imports are paid once); it ends when this process does (its socket closes)."""
    global _shared
    if _shared is None or not _shared.alive():
        _shared = Spawner()
    return _shared


class SpawnError(RuntimeError):
    """The spawning process is gone (it exits with the lab, or failed to start)."""


class Spawner:
    """The lab's side: starts the spawning process, asks it for children, hears how they end."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "swarm.lab.spawn", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is the lab's to handle, not this one's
        )
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one request at a time: its answer is the next "started"
        self._started: list[int] = []
        self._ended: dict[int, int] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._listen, name="lab-spawner", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MESSAGE)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self.sock.close()
                    self._started.append(-1)  # wakes a request waiting for its answer
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "started" in message:
                    self._started.append(message["started"])
                else:
                    self._ended[message["ended"]] = message["code"]
                self._changed.notify_all()

    def spawn(self, module: str, args: list[str], env: dict, cwd: str, fds: list[int], namespace: str | None) -> int:
        """The pid of a new child running `python -m module *args`, `fds` its stdin, stdout and stderr."""
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd, "netns": namespace})
        with self._lock:
            try:
                socket.send_fds(self.sock, [request.encode()], fds)
            except OSError as e:
                raise SpawnError(f"the lab's spawning process is gone ({e})") from None
            with self._changed:
                self._changed.wait_for(lambda: self._started)
                pid = self._started.pop(0)
        if pid < 0:
            raise SpawnError(f"the lab's spawning process is gone (exit code {self.server.poll()})")
        return pid

    def wait_ended(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code (negative: the signal that ended it), or None if it runs past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended or self.sock.fileno() < 0, timeout)
            if pid in self._ended or self.sock.fileno() >= 0:
                return self._ended.get(pid)
        # the spawning process is gone (killed): its children went to init, which keeps their
        # status; one that no longer exists is taken to have been killed
        while pid_alive(pid):
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
        return -signal.SIGKILL

    def preload(self, *modules: str) -> None:
        """Imports `modules` in the spawning process, for every child it starts afterwards (one that
        cannot be imported is left to the child to fail on, as it would without this)."""
        if modules:
            with self._lock:
                self.sock.send(json.dumps({"preload": list(modules)}).encode())

    def alive(self) -> bool:
        return self.server.poll() is None and self.sock.fileno() >= 0

    def close(self) -> None:
        """Ends the spawning process (its children go on: the lab stops them)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def popen(self, command: list[str], namespace: str | None = None, **options) -> SpawnedProcess:
        """`command` is `[python, '-m', module, *args]`, run in network namespace `namespace` if given;
        `options` as subprocess.Popen's (stdin, stdout and stderr: a pipe, DEVNULL, STDOUT or this process's)."""
        return SpawnedProcess(self, namespace, command, **options)


class SpawnedProcess(subprocess.Popen):
    """A child of the spawning process, followed as a subprocess.Popen: pipes, poll, wait, signals."""

    def __init__(self, spawner: Spawner, namespace: str | None, command: list[str], **options) -> None:
        if command[1:2] != ["-m"] or len(command) < 3:
            raise ValueError(f"a spawned process runs `python -m MODULE ...`, not {command[:3]}")
        self._spawner, self._namespace = spawner, namespace
        super().__init__(command, **options)

    def _execute_child(self, *given) -> None:
        """Popen's hook that starts the child, given Popen's positional arguments (args, executable,
        preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell, then the pipes'
        ends): here the spawning process forks it."""
        args, cwd, env = given[0], given[5], given[6]
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = given[10:16]
        # where Popen made no pipe the child writes to this process's stream, as a new interpreter
        # would; it reads nothing it was not given (this process's stdin may be closed)
        null = os.open(os.devnull, os.O_RDONLY)
        streams = [
            p2cread if p2cread != -1 else null,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        try:
            self.pid = self._spawner.spawn(
                args[2],
                list(args[3:]),
                dict(env if env is not None else os.environ),
                os.fspath(cwd) if cwd is not None else os.getcwd(),
                streams,
                self._namespace,
            )
        finally:  # the child's ends of the pipes, as Popen closes them once a child has its own
            for end, ours in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if end != -1 and ours != -1:
                    os.close(end)
            os.close(null)
            if hasattr(self, "_devnull"):
                os.close(self._devnull)
        self._child_created = True

    def _internal_poll(self, _deadstate=None, **_) -> int | None:
        if self.returncode is None:
            self.returncode = self._spawner.wait_ended(self.pid, 0)
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is None:
            self.returncode = self._spawner.wait_ended(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


# ------------------------------------------------------------------ the spawning process


def _serve(sock: socket.socket) -> dict | None:
    """Forks a child per request; returns its request in the child, None here once the lab is gone."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    while True:
        readable, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        while True:  # every child that ended, whichever woke us
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"ended": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if sock not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
        if not data:
            return None
        if "preload" in (request := json.loads(data)):
            _import(request["preload"])
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (wake_read, wake_write):
                os.close(fd)
            sock.close()
            return dict(request, fds=fds)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"started": pid}).encode())


def _import(modules) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the child that needs it fails with the error itself
            pass


def _become(request: dict) -> None:
    """In the child: a new session, its streams, the lab's environment and namespace, then the module."""
    os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
    for fd in set(request["fds"]) - {0, 1, 2}:
        os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    for option in filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # what a new interpreter reads from it at its start
    os.chdir(request["cwd"])
    if request["netns"]:
        namespace = os.open(f"/var/run/netns/{request['netns']}", os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(namespace, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {request['netns']}")
        os.close(namespace)
    # unbuffered as PYTHONUNBUFFERED=1 makes a new interpreter: every line reaches the lab at once
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True, write_through=True
    )
    module = request["module"]
    sys.argv = [module, *request["args"]]
    sys.modules.pop(module, None)  # imported here beforehand; it runs anew as __main__, as under -m
    os._exit(_run(module))


def _run(module: str) -> int:
    """The module as `python -m` runs it, and the exit code the interpreter would give. The end is an
    interpreter's, but for tearing the modules down: it waits for the threads that are not daemons,
    runs the atexit handlers and flushes; freeing every module of torch and hivemind (a fresh
    interpreter's habit) took seconds per peer under load, for a process that is about to end."""
    import atexit
    import runpy
    import traceback

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does first when the main module ends
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # as Python does after an uncaught KeyboardInterrupt: end by the signal itself
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(code) -> int:
    """sys.exit's argument as the interpreter turns it into a status: None 0, a number itself, else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    _import(PRELOAD)
    request = _serve(sock)
    if request is None:  # the lab is done: nothing here to flush or close, and tearing torch down takes seconds
        os._exit(0)
    _become(request)


if __name__ == "__main__":
    main(sys.argv[1:])
