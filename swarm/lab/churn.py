"""`swarm lab --churn SPEC`: stage peers that join, die and leave, and a trainer that dies, while
the lab's run goes on.

A SPEC is either a schedule, comma-separated `ACTION:STAGE@WHEN` events, WHEN in seconds from the
moment the trainer has set the stages up, or `stepN`: once the trainer has finished step N:
    join:1@0,kill:1@20,stop:2@step300,join:2@45,kill:trainer@step400
or `random:SEED[@EVERY]`: an event about every EVERY seconds (default 30), drawn with SEED: a
join, a kill or a stop of a random stage's peer. Random events never take a stage's last peer;
scheduled ones do what they say (a stop of a stage's last peer waits for another to join). A
schedule may hold one `random:` item too: both happen (`random:7@20,join:1@0,kill:trainer@step900`
gives stage 1 a replica from the start and kills the trainer once, amid random churn).

- join: a new stage peer process, started as a volunteer would (`--stage`, `--initial_peers`,
  `--run_id`; its config comes from the swarm);
- kill: SIGKILL to the process group of the stage's oldest live peer (the peer and its p2p daemon
  die at once, as a machine that loses power);
- stop: SIGTERM to it (it drains: finishes what it holds and leaves at a step boundary);
  a kill or stop waits (at most JOIN_WAIT_S) while a joiner of its stage is still joining: the
  joiner downloads its state from the peers there, and how fast a process starts is not the
  schedule's to decide;
- kill:trainer: SIGKILL to the trainer's process group; RESTART_PAUSE_S later the lab starts it
  again with the same command line, and it takes the run over from the copies the stage peers keep
  (its --snapshot_every). The churn clock goes on; join and stop take stages only.
"""

from __future__ import annotations

import random
import re
import signal
from dataclasses import dataclass

ACTIONS = ("join", "kill", "stop")
TRAINER = "trainer"  # the target of kill:trainer@WHEN
DEFAULT_EVERY_S = 30.0
RESTART_PAUSE_S = 2.0  # from killing the trainer to starting it again
JOIN_WAIT_S = 60.0  # the longest a kill or stop waits for a joiner of its stage to finish joining
_EVENT = re.compile(r"^(join|kill|stop):(\d+|trainer)@(?:(\d+(?:\.\d*)?)s?|step(\d+))$")
_RANDOM = re.compile(r"^random:(\d+)(?:@(\d+(?:\.\d*)?)s?)?$")


@dataclass(frozen=True)
class ChurnEvent:
    at_s: float  # seconds after the trainer's setup (inf: at a step)
    action: str
    stage: int | str  # a stage, or TRAINER
    at_step: int | None = None  # once the trainer finished this step

    def due(self, elapsed_s: float, step: int) -> bool:
        return self.at_step <= step if self.at_step is not None else self.at_s <= elapsed_s


class ChurnError(ValueError):
    """A churn SPEC that does not parse, or names a stage the run does not have."""


@dataclass
class Churn:
    """The events still to come: fixed ones, or drawn as the run goes (`random`)."""

    events: list[ChurnEvent]
    seed: int | None = None
    every_s: float = DEFAULT_EVERY_S

    @classmethod
    def parse(cls, spec: str, stages: int) -> Churn:
        events, seed, every = [], None, DEFAULT_EVERY_S
        for item in filter(None, (part.strip() for part in spec.split(","))):
            if match := _RANDOM.match(item):
                if seed is not None:
                    raise ChurnError(f"--churn: {item!r}: one random:SEED item at most")
                seed, every = int(match.group(1)), float(match.group(2)) if match.group(2) else DEFAULT_EVERY_S
                if every <= 0:
                    raise ChurnError(f"--churn {item}: the interval must be positive")
            else:
                events.append(cls._event(item, stages))
        if not events and seed is None:
            raise ChurnError("--churn: no events given")
        return cls(sorted(events, key=lambda e: (e.at_s, e.at_step or 0)), seed=seed, every_s=every)

    @staticmethod
    def _event(item: str, stages: int) -> ChurnEvent:
        match = _EVENT.match(item)
        if match is None:
            raise ChurnError(
                f"--churn: {item!r} is not ACTION:STAGE@SECONDS or ACTION:STAGE@stepN (ACTION one of {', '.join(ACTIONS)}; STAGE a number, or trainer for kill), or random:SEED[@EVERY]"
            )
        stage = match.group(2) if match.group(2) == TRAINER else int(match.group(2))
        if stage == TRAINER and match.group(1) != "kill":
            raise ChurnError(f"--churn: {item!r}: the trainer can only be killed (kill:trainer@WHEN)")
        if stage != TRAINER and stage >= stages:
            raise ChurnError(f"--churn: {item!r} names stage {stage}, the run has stages 0..{stages - 1}")
        if match.group(4) is not None:
            return ChurnEvent(float("inf"), match.group(1), stage, int(match.group(4)))
        return ChurnEvent(float(match.group(3)), match.group(1), stage)

    def joiners(self, replicas: dict[int, int] | None = None) -> list[str] | None:
        """The names of the stage peers its joins will start, in order (stage1.2, ...: numbered on
        after the `replicas` each stage starts with); None when they are drawn as the run goes (random)."""
        if self.seed is not None:
            return None
        count = dict(replicas or {})
        names = []
        for event in self.events:
            if event.action == "join":
                count[event.stage] = count.get(event.stage, 1) + 1
                names.append(f"stage{event.stage}.{count[event.stage]}")
        return names

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._next_random = self._draw_gap() if self.seed is not None else None

    def _draw_gap(self) -> float:
        return self._random.uniform(0.5, 1.5) * self.every_s

    def due(self, elapsed_s: float, live: dict[int, int], step: int = 0) -> list[ChurnEvent]:
        """The events due by `elapsed_s` and the trainer's `step`; `live`: stage -> its live peers
        (random events keep one)."""
        due = [e for e in self.events if e.due(elapsed_s, step)]
        self.events = [e for e in self.events if not e.due(elapsed_s, step)]
        for event in due:  # the random draws below see the scheduled joins, kills and stops
            if event.stage != TRAINER and self.seed is not None:
                live[event.stage] += 1 if event.action == "join" else -1
        while self._next_random is not None and self._next_random <= elapsed_s:
            stage = self._random.randrange(len(live))
            action = self._random.choice(ACTIONS)
            if action != "join" and live[stage] < 2:
                action = "join"
            due.append(ChurnEvent(self._next_random, action, stage))
            live[stage] += 1 if action == "join" else -1
            self._next_random += self._draw_gap()
        return due


class ChurnRunner:
    """Carries a `Churn` out on a lab's stage peer processes and its trainer (`lab`: its `Lab`, whose
    `trainer` follows the trainer's current process and holds its arguments)."""

    def __init__(self, lab, churn: Churn, join_args: list[str]) -> None:
        self.lab, self.churn, self.join_args = lab, churn, join_args
        plan = lab.run_plan
        replicas = {s: plan.replicas.get(s, 1) for s in range(plan.stages)}  # the peers each stage starts with
        self.live: dict[int, list[str]] = {s: [f"stage{s}"] for s in range(plan.stages)}
        for stage, name in plan.replica_names():
            self.live[stage].append(name)
        self.gone: set[str] = set()  # peers the churn killed or stopped: their exit is expected
        self.counts = {action: 0 for action in ACTIONS}
        self.peers_started = replicas
        self.started: float | None = None  # when the trainer had set the stages up
        self.restart_at: float | None = None  # the killed trainer starts again then
        self.held: list[tuple[ChurnEvent, float]] = []  # kills and stops waiting for a joiner, since when

    @property
    def restarting(self) -> bool:
        """The trainer was killed and is not started again yet: the run is not over."""
        return self.restart_at is not None

    def poll(self, now: float, step: int) -> None:
        """`step`: the trainer's last finished step. The clock starts once the trainer has set the
        stages up (the lab's `trainer.ready`), and goes on across a trainer's restart."""
        if self.started is None:
            if not self.lab.trainer.ready.is_set():
                return
            self.started = now
        if self.restart_at is not None and now >= self.restart_at:
            self._restart_trainer()
        elapsed = now - self.started
        due = self.churn.due(elapsed, {s: len(names) for s, names in self.live.items()}, step)
        self.held += [(event, now) for event in due]
        held, self.held = self.held, []
        for event, since in held:
            if event.stage == TRAINER:
                self._kill_trainer(now, elapsed)
            elif event.action != "join" and (joiner := self._joining(event.stage)) and now - since < JOIN_WAIT_S:
                if now == since:
                    self.lab.output.say(
                        "lab", f"churn at {elapsed:.1f}s: {event.action} stage {event.stage} waits for {joiner} to join"
                    )
                self.held.append((event, since))
            else:
                self._do(event, elapsed)

    def _joining(self, stage: int) -> str | None:
        """A peer the churn started for `stage` that is alive and has not joined the run yet."""
        processes = dict(self.lab.processes)
        for name in self.live[stage]:
            process = processes.get(name)
            if "." in name and name not in self.lab.joined_peers and process is not None and process.poll() is None:
                return name
        return None

    def _kill_trainer(self, now: float, elapsed: float) -> None:
        self.lab.signal_peer(self.lab.trainer.process, signal.SIGKILL)  # its p2p daemon too
        self.restart_at = now + RESTART_PAUSE_S
        self.counts["kill"] += 1
        self.lab.output.say("lab", f"churn at {elapsed:.1f}s: kill trainer")

    def _restart_trainer(self) -> None:
        """The same command line again; the dead process leaves the lab's list (stop() skips it)."""
        lab, old = self.lab, self.lab.trainer.process
        if old.poll() is None:
            return  # not gone yet (SIGKILL takes it at once): the next poll looks again
        self.restart_at = None
        lab.processes[:] = [(name, process) for name, process in lab.processes if process is not old]
        lab._start(TRAINER, "peers.trainer", *lab.trainer.command)
        lab.output.say("lab", "churn: trainer started again")

    def _do(self, event: ChurnEvent, elapsed: float) -> None:
        lab, names = self.lab, self.live[event.stage]
        if event.action == "join":
            self.peers_started[event.stage] += 1
            name = f"stage{event.stage}.{self.peers_started[event.stage]}"
            lab._start(name, "peers.stage", "--stage", str(event.stage), *self.join_args)
            names.append(name)
        else:
            if not names:
                lab.output.say(
                    "lab", f"churn at {elapsed:.1f}s: {event.action} stage {event.stage}: no live peer, skipped"
                )
                return
            name = names.pop(0)  # the oldest: the one micro-batches most likely follow
            self.gone.add(name)
            process = dict(lab.processes)[name]
            lab.signal_peer(process, signal.SIGKILL if event.action == "kill" else signal.SIGTERM)
        self.counts[event.action] += 1
        lab.output.say("lab", f"churn at {elapsed:.1f}s: {event.action} {name}")
