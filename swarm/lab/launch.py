"""`python -m swarm lab CONFIG --stages S`: a whole swarm on this machine, as separate processes.

It starts a bootstrap peer, S stage peers (with `--replicas`, several of a stage) and a trainer
(each its own process with its own p2p daemon), prefixes and streams their output, and stops every one of them, daemons included, when
the trainer ends, on error and on Ctrl-C.

With `--bandwidth` / `--delay` the links are shaped. `netns` (the default as root): every process
gets its own network namespace and access link (swarm.netlab.namespaces), rate limited by tc in
both directions, with the delay from netem where the kernel has it and otherwise added on each
process's send path in process; a probe measures the links before the run. `inprocess`: processes
on loopback pace what they send themselves (peers' --shape_rate / --shape_delay; no root needed).
Either way each stage peer and the trainer is told its link rate (--uplink / --downlink), so it
paces every neighbour flow at its share (swarm.transport.hivemind.flow.pacing), unless `pacing` is off.

The stage peers and the trainer share this machine's cores: each gets `--threads` = cores over
their number (at least one). Left at torch's default, every process would run a thread per core,
all competing for the same cores (docs/bench/README.md says what that cost).
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.config import ConfigError, load_config
from swarm.lab.churn import ChurnRunner
from swarm.lab.lab_probe import probe_inprocess, probe_namespaces
from swarm.lab.plan import (
    LinkOptions,
    LinkPlan,
    RunOptions,
    RunPlan,
    available_cores,
    base_name,
    nat_names,
)
from swarm.lab.spawn import Spawner, shared_spawner
from swarm.models.registry import model_libraries, stage_count_problem
from swarm.netlab.counters import CounterSampler, GroupCpu
from swarm.netlab.namespaces import NetLab, NetlabError
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.trainer.dispatch import micro_batches_in_flight

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
_STEP_LINE = re.compile(r"^step (\d+)(?:/\d+)?: ")  # the trainer's line per step (peers.trainer)
_JOINED = "joined with the state of step"  # a joining stage peer's line once it has its state (stage/joining.py)
_NOISE = ("FutureWarning", "warnings.warn", "use of closed network connection")  # harmless shutdown chatter


class PrefixedOutput:
    """The lab's and its processes' lines, each `[name] line`, on one stream; written whole, since
    every process's output is pumped by a thread of its own."""

    def __init__(self, out) -> None:
        self.out = out
        self._lock = threading.Lock()

    def say(self, name: str, line: str) -> None:
        with self._lock:
            self.out.write(f"[{name}] {line}\n")
            self.out.flush()


@dataclass
class TrainerProcess:
    """The trainer as the lab follows it: a churn may kill it and start it again with the same
    `command`, and its clock starts once the trainer is `ready` (it set the stages up)."""

    process: subprocess.Popen | None = None  # the current one
    command: list[str] = field(default_factory=list)  # its arguments, for a restart
    ready: threading.Event = field(default_factory=threading.Event)
    step: int = 0  # the last step it printed


class Lab:
    """The swarm on this machine: what it will run (`run_plan`, `link_plan`, checked when the lab is
    made) and, while it runs, its processes, their namespaces (`net`) and the trainer it follows."""

    stage_peers_limit_in_flight = True  # they take at most max_requests_per_sender micro-batches of one sender

    def __init__(
        self,
        config: str,
        stages: int,
        run: RunOptions | None = None,
        links: LinkOptions | None = None,
        out=None,
        startup_timeout: float = 90.0,
    ) -> None:
        """ValueError or ChurnError (one line) for an option that does not parse or does not fit."""
        links = links or LinkOptions()
        self.run_plan = RunPlan.of(config, stages, run or RunOptions())
        self.link_plan = LinkPlan.of(self.run_plan.names, links)
        nat_stages = nat_names(links.nat, stages)
        if nat_stages and self.link_plan.shaping != "netns":
            raise ValueError("--nat needs namespaces (as root, without --shaping inprocess)")
        # every process that will run gets its namespace before the run: replicas and a churn's joiners too
        self.names = list(self.run_plan.names) + [name for _, name in self.run_plan.replica_names()]
        if self.run_plan.churn is not None and (self.link_plan.in_namespaces or nat_stages):
            joiners = self.run_plan.churn.joiners(self.run_plan.replicas)
            if joiners is None:
                raise ValueError(
                    "random --churn needs --shaping inprocess and no --nat (its joiners are not known before)"
                )
            self.names += joiners
        self.nat = [name for name in self.names if base_name(name) in nat_stages]  # each behind its own router
        self.output = PrefixedOutput(out or sys.stdout)
        self.startup_timeout = startup_timeout
        self.net: NetLab | None = None  # while the run is in namespaces
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.trainer = TrainerProcess()
        self._boot_lines: queue.Queue[str] = queue.Queue()  # the bootstrap's output, for its address
        self.joined: tuple[str, str] = ("", "")  # the bootstrap's address and the run id, once started
        self.joined_peers: set[str] = set()  # the churn's joiners that have their state (a kill waits)
        self.spawner: Spawner | None = None  # forks the peers from imports done once (swarm.lab.spawn)

    def _host(self, name: str) -> str:
        return self.net.maddr(name) if self.net is not None else LOOPBACK

    def _start(self, name: str, module: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        command = [
            sys.executable,
            "-m",
            module,
            *args,
            "--host_maddrs",
            self._host(name),
            *self.link_plan.shape_args(name, self.net),
            *self.link_plan.link_args(name),
        ]
        process = self.spawner.popen(
            command,
            self.net.namespace(name) if self.net is not None else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
        )
        self.processes.append((name, process))
        trainer = self.trainer
        if name == "trainer":
            trainer.process = process

        def pump() -> None:
            for line in process.stdout:
                line = line.rstrip()
                if name == "bootstrap":
                    self._boot_lines.put(line)
                if name == "trainer" and line.startswith("run "):
                    trainer.ready.set()
                if _JOINED in line:
                    self.joined_peers.add(name)
                if process is trainer.process and (step := _STEP_LINE.match(line)):  # not a killed one's
                    trainer.step = int(step.group(1))
                if line and not any(noise in line for noise in _NOISE):
                    self.output.say(name, line)

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
        try:
            cfg = load_config(self.run_plan.config, self.run_plan.overrides)
            if problem := stage_count_problem(cfg.model.name, cfg.model.num_stages, cfg.model.options):
                raise ValueError(problem)  # before a peer starts (each would build the model to find it)
            if self.stage_peers_limit_in_flight:  # by the default settings, which a trainer meets only once they are up
                micro_batches_in_flight(cfg.train.in_flight, self.run_plan.stages, Settings())
        except (ConfigError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        self.spawner = shared_spawner()  # its imports run while the lab sets the links up and probes them
        links = self.link_plan
        if not (links.in_namespaces or self.nat):
            if links.shaped:
                self.output.say("lab", f"in-process shaping: {links.describe_inprocess()}")
                if links.probe:
                    probe_inprocess(self)
            return self._run_swarm(cfg)
        try:
            rates = {name: links.rate(name) for name in self.names} if links.rates else None
            with NetLab(self.names, rates, links.delay, nat=self.nat) as net:
                self.net = net
                for line in net.summary().splitlines():
                    self.output.say("netlab", line)
                if links.probe and links.shaped and self.nat:
                    self.output.say("lab", "no link probe: it dials every process, and nobody can dial one behind NAT")
                elif links.probe and links.shaped:
                    probe_namespaces(self)
                return self._run_swarm(cfg)
        except NetlabError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # a signal during setup or teardown
            return 130
        finally:
            self.net = None

    def _start_peers(self, cfg) -> ChurnRunner | None:
        """The bootstrap, the stage peers and the trainer (and the churn that will come and go)."""
        plan, run_id = self.run_plan, f"{cfg.name}-{secrets.token_hex(3)}"
        boot = self._start("bootstrap", "peers.bootstrap")
        self.spawner.preload(*model_libraries(cfg.model.name))  # while the bootstrap starts: the others need them
        initial = self._bootstrap_address(boot)
        self.joined = (initial, run_id)
        joining = ["--run_id", run_id, "--initial_peers", initial, "--threads", str(plan.threads)]
        common = ["--config", plan.config, *joining, *plan.set_args()]
        computing = sum(plan.replicas.values()) + 1
        self.output.say(
            "lab",
            f"torch threads per peer: {plan.threads} ({computing} peers computing, {available_cores()} cores)",
        )
        for stage in range(plan.stages):
            self._start(
                f"stage{stage}", "peers.stage", "--stage", str(stage), *common, *self._trace_args(f"stage{stage}")
            )
        # a stage's other peers start as a volunteer's would (as the churn's joiners): the run's
        # config from the swarm; the trainer sets up those it finds, and admits the later ones
        join_args = joining + (["--device", plan.device] if plan.device else [])
        for stage, name in plan.replica_names():
            self._start(name, "peers.stage", "--stage", str(stage), *join_args, *self._trace_args(name))
        self.trainer.command = [*common, *plan.results_args(), *plan.trainer_args, *self._trace_args("trainer")]
        self._start("trainer", "peers.trainer", *self.trainer.command)
        if plan.churn is None:
            return None
        return ChurnRunner(self, plan.churn, join_args)

    def _trace_args(self, name: str) -> list[str]:
        """Where a peer writes its timeline when the lab writes the run's (merged at the end)."""
        return ["--trace", str(Path(f"{self.run_plan.trace}.parts") / f"{name}.json")] if self.run_plan.trace else []

    def _write_timeline(self) -> None:
        """Every peer's timeline as one (clocks aligned), and what each spent its time on."""
        from swarm.timeline import load, merge, where_time_goes

        parts = sorted(Path(f"{self.run_plan.trace}.parts").glob("*.json"))
        if not parts:
            return
        merged = merge([load(path) for path in parts])
        Path(self.run_plan.trace).write_text(json.dumps(merged))
        for line in where_time_goes(merged):
            self.output.say("lab", line)
        self.output.say(
            "lab", f"timeline in {self.run_plan.trace} (Perfetto, chrome://tracing; python -m swarm timeline)"
        )

    def _show_how_peers_were_reached(self) -> None:
        """peers.status from the bootstrap's namespace, before the peers stop: its `reached` column
        says how each peer behind NAT was reached (swarm.transport.hivemind.net.reach)."""
        initial, run_id = self.joined
        command = [sys.executable, "-m", "peers.status", "--initial_peers", initial, "--run_id", run_id]
        status = self.spawner.popen(
            command, self.net.namespace("bootstrap"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            out, _ = status.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            status.kill()
            status.wait()
            self.output.say("lab", "peers.status did not answer within 120 s")
            return
        for line in out.splitlines():
            if line.strip() and not any(noise in line for noise in _NOISE):
                self.output.say("status", line)

    def _may_exit(self, process: subprocess.Popen) -> bool:
        """Whether a peer other than the trainer may end before the trainer (never, in a swarm)."""
        return False

    def _run_swarm(self, cfg) -> int:
        try:
            # each peer leads its own process group, its p2p daemon in it
            processes = GroupCpu(lambda: {name: process.pid for name, process in self.processes})
            counters = (
                CounterSampler(self.net.link_bytes if self.net is not None else dict, processes)
                if self.run_plan.results
                else None
            )
            churn = self._start_peers(cfg)
            gone = churn.gone if churn is not None else set()  # peers the churn took: their exit is expected
            trainer = self.trainer
            while trainer.process.poll() is None or getattr(churn, "restarting", False):
                if churn is not None:  # its clock starts once the trainer has set the stages up
                    churn.poll(time.monotonic(), trainer.step)
                for name, process in list(self.processes):
                    ended = process.poll() is not None and name not in gone and not self._may_exit(process)
                    if process is not trainer.process and ended:
                        raise RuntimeError(f"{name} exited with code {process.returncode}")
                if counters is not None:
                    counters.poll()
                time.sleep(0.2)
            if self.nat and trainer.process.returncode == 0:
                self._show_how_peers_were_reached()
            if counters is not None and trainer.process.returncode == 0:
                # the links' own byte counts and the CPU, for bench throughput
                counters.sample()
                with open(self.run_plan.results, "a") as f:
                    f.write(json.dumps(counters.to_row()) + "\n")
            return trainer.process.returncode  # the last trainer's: a killed one's is the churn's doing
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            self.output.say("lab", "interrupted: stopping every peer")
            return 130
        finally:
            self.stop()
            if self.run_plan.trace:
                self._write_timeline()
            results = self.run_plan.results
            if results and Path(results).exists():
                self.output.say("lab", f"results in {results}")

    def signal_peer(self, process: subprocess.Popen, sig: int) -> None:
        """SIGKILL to a peer's whole process group (its p2p daemon dies with it); other signals to the peer."""
        try:
            if sig == signal.SIGKILL:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """SIGINT (graceful), then SIGTERM, then SIGKILL to each process group (its p2p daemon too)."""
        running = [(name, p) for name, p in reversed(self.processes)]
        for sig, grace in ((signal.SIGINT, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for _, process in running:
                try:  # first only the peer itself: it shuts its daemon down; then the whole group
                    if sig is signal.SIGINT:  # twice: the run is over, a stage peer need not drain
                        process.send_signal(sig)
                        time.sleep(0.05)
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


def run_lab(config: str, stages: int, run: RunOptions, links: LinkOptions) -> int:
    """The lab's exit code: 2 for an option that does not parse or does not fit (one line)."""
    try:
        lab = Lab(config, stages, run, links)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return lab.run()
