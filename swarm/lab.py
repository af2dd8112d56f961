"""`python -m swarm lab CONFIG --stages S`: a whole swarm on this machine, as separate processes.

It starts a bootstrap peer, S stage peers and a trainer (each its own process with its own p2p
daemon, on loopback), prefixes and streams their output, and stops every one of them, daemons
included, when the trainer ends, on error and on Ctrl-C.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
_NOISE = ("FutureWarning", "warnings.warn", "use of closed network connection")  # harmless shutdown chatter


class Lab:
    def __init__(self, config: str, stages: int, results: str | None = None, steps: int | None = None, overrides: list[str] | None = None, device: str | None = None, out=None, startup_timeout: float = 90.0, trainer_args: list[str] | None = None) -> None:
        self.config, self.stages, self.results, self.steps = config, stages, results, steps
        self.trainer_args = list(trainer_args or [])  # e.g. --checkpoint_dir DIR
        self.overrides = [*(overrides or []), f"model.num_stages={stages}", *([f"device={device}"] if device else [])]
        self.out = out or sys.stdout
        self.startup_timeout = startup_timeout
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self._lock = threading.Lock()
        self._boot_lines: queue.Queue[str] = queue.Queue()

    def _print(self, name: str, line: str) -> None:
        with self._lock:
            self.out.write(f"[{name}] {line}\n")
            self.out.flush()

    def _start(self, name: str, module: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", module, *args]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True)
        self.processes.append((name, process))

        def pump() -> None:
            for line in process.stdout:
                line = line.rstrip()
                if name == "bootstrap":
                    self._boot_lines.put(line)
                if line and not any(noise in line for noise in _NOISE):
                    self._print(name, line)

        threading.Thread(target=pump, name=f"lab-{name}", daemon=True).start()
        return process

    def _bootstrap_address(self, process: subprocess.Popen) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the bootstrap peer exited with code {process.returncode}")
            try:
                line = self._boot_lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line.startswith("/ip4/"):
                return line
        raise RuntimeError(f"the bootstrap peer printed no address within {self.startup_timeout:.0f}s")

    def run(self) -> int:
        from swarm.config import ConfigError, load_config

        try:
            cfg = load_config(self.config, self.overrides)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        run_id = f"{cfg.name}-{secrets.token_hex(3)}"
        sets = [arg for item in self.overrides for arg in ("--set", item)]
        try:
            boot = self._start("bootstrap", "peers.bootstrap", "--host_maddrs", LOOPBACK)
            initial = self._bootstrap_address(boot)
            common = ["--config", self.config, "--run_id", run_id, "--initial_peers", initial, "--host_maddrs", LOOPBACK, *sets]
            for stage in range(self.stages):
                self._start(f"stage{stage}", "peers.stage", "--stage", str(stage), *common)
            extra = (["--results", str(self.results)] if self.results else []) + (["--steps", str(self.steps)] if self.steps else [])
            trainer = self._start("trainer", "peers.trainer", *common, *extra, *self.trainer_args)
            while trainer.poll() is None:
                for name, process in self.processes:
                    if process is not trainer and process.poll() is not None:
                        raise RuntimeError(f"{name} exited with code {process.returncode}")
                time.sleep(0.2)
            return trainer.returncode
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            self._print("lab", "interrupted: stopping every peer")
            return 130
        finally:
            self.stop()
            if self.results and Path(self.results).exists():
                self._print("lab", f"results in {self.results}")

    def stop(self) -> None:
        """SIGINT (graceful), then SIGTERM, then SIGKILL to each process group (its p2p daemon too)."""
        running = [(name, p) for name, p in reversed(self.processes)]
        for sig, grace in ((signal.SIGINT, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for _, process in running:
                try:  # first only the peer itself: it shuts its daemon down; then the whole group
                    if sig is signal.SIGINT:
                        process.send_signal(sig)
                    else:
                        os.killpg(process.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            for _, process in running:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if sig is not signal.SIGKILL:
                running = [(n, p) for n, p in running if p.poll() is None or _group_alive(p.pid)]
            if not running:
                break
        self.processes.clear()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def run_lab(config: str, stages: int, results: str | None = None, steps: int | None = None, overrides: list[str] | None = None, device: str | None = None, trainer_args: list[str] | None = None) -> int:
    return Lab(config, stages, results, steps, overrides, device, trainer_args=trainer_args).run()
