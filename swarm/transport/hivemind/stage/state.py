"""A hosted stage's state, typed and in pieces, so that each collaborator (the chain, the rounds,
joining, the copies, status) takes the pieces it uses and none takes the whole host:

- `StagePlace`: which stage of which run, on which peer, with which config: set once.
- `StageState`: the stage as the run has it now (config in force, runtime, session, step, joining
  or leaving). It changes only through its own methods, each a transition of the stage's life.
- `StageMeters`: what its status and DHT record report of its work.
- `PeerServices`: what the peer's server lends every stage it hosts (set when hosted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.config import ExperimentConfig
from swarm.engine.checkpoint import stage_state
from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.flow.busy import Busy
from swarm.transport.hivemind.net.events import EventLog
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.routing.router import RoutingPolicy
from swarm.transport.hivemind.stage.attempts import HeldAttempts
from swarm.transport.hivemind.stage.clock import ComputeClock

log = logging.getLogger(__name__)


@dataclass
class StagePlace:
    node: SwarmNode
    run_id: str
    stage: int
    num_stages: int
    digest: str  # of the config fields a stage depends on (a setup with another is refused)
    token: bytes = b""  # a private run's allowance (serialized pb.Token), shown in its record

    @property
    def settings(self):
        return self.node.settings

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass
class PeerServices:
    """Lent by the peer's server: its event log, its replica averager and a way to announce the
    stage's record at once when it changes (joined, left the session, leaving)."""

    events: EventLog = field(default_factory=EventLog)
    averager: object = None  # stage.averaging.ReplicaAverager, once hosted
    changed: Callable[[], None] = lambda: None


class StageState:
    """The stage as the run has it now."""

    def __init__(self, place: StagePlace, cfg: ExperimentConfig) -> None:
        self.place = place
        self.configured = cfg  # what a new trainer session starts from
        self.cfg = cfg  # in force: adaptive compression and restores change its codecs
        self.runtime = None  # swarm.engine.stage.StageRuntime, once set up
        self.session: tuple | None = None  # (trainer session, lr horizon, capacity) it was set up for
        self.tied: list = []
        self.steps = 0  # optimizer steps taken
        self.joining = None  # stage.joining.Joining while it catches up after joining mid-run
        self.joined: tuple[int, int, float] | None = None  # (step, state bytes, seconds) of its join
        self.leaving = False  # draining: it takes no new micro-batch and leaves after this step
        self.generation = 0  # bumped when the state starts afresh or goes back: its steps count anew
        self.attempts = HeldAttempts()  # which attempt of each micro-batch the runtime holds gradients of
        # train.schedule async (swarm.engine.delay): the (generation, step)s whose held gradients a
        # round counted (their norm) or a restore installed, so their decisions apply them
        # (stage.closing); two at most, as two steps are open at once
        self.counted: list[tuple[int, int]] = []
        self.rates: dict[tuple[int, int], float] = {}  # async: (generation, step) -> the rate it ran at here
        # async: (generation, step) -> its tied parameters' totals over both stages (stage.combine)
        self.tied_totals: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def session_id(self) -> str:
        return self.session[0] if self.session else ""

    @property
    def role(self) -> str:
        if self.runtime is None:
            return "idle"
        if self.joining is not None:
            return "following"
        return "leaving" if self.leaving else "serving"

    def ready(self) -> None:
        if self.runtime is None:
            raise RemoteError(f"stage {self.place.stage} of run {self.place.run_id!r} is not set up yet", pb.NOT_READY)

    def at(self, step: int, what: str) -> None:
        """Raises unless its weights are at `step` (it missed a round, or is ahead)."""
        if step != self.steps:
            raise RemoteError(
                f"stage {self.place.stage} peer is at step {self.steps}, {what} of step {step}", pb.UNAVAILABLE
            )

    def drained(self, step: int) -> int:
        """The optimizer steps taken by a state drained after `step` of the loop's steps: with an
        asynchronous schedule the last step's gradients are held, not applied yet (swarm.engine.delay)."""
        return max(step - 1, 0) if self.cfg.train.schedule == "async" else step

    def saved(self, ends, step: int, in_flight: bool = False) -> dict:
        """This stage drained after `step` of the loop's steps, as one process's stage file
        (swarm.engine.checkpoint): with an asynchronous schedule the last step's held gradients,
        summed, are its kept ones, so either transport resumes the other's."""
        if self.runtime.delay is not None and self.steps != self.drained(step):
            raise RemoteError(
                f"stage {self.place.stage} peer has applied {self.steps} step(s): it holds no state of step {step}",
                pb.UNAVAILABLE,
            )
        saved = stage_state(self.runtime, ends, step, in_flight)
        if self.runtime.delay is not None:
            kept = self.runtime.held_kept(step - 1, self.cfg.train.micro_batches) if step else None
            versions = self.runtime.versions
            then = versions.weights_of(step - 1) if versions is not None and kept is not None else None
            # dc's weights of the held step and lookahead's last move: what one process keeps
            saved["delay"] = {"kept": kept, "then": then, "moved": self.runtime.delay.moved}
        return saved

    def serving(self) -> tuple[int, int]:
        """The first and last step whose micro-batches its weights serve: after n updates, step n;
        with an asynchronous schedule (swarm.engine.delay) step n + 1, each update applying the
        gradients of the step before the last (the first step applies nothing: steps 0 and 1 both
        run at the initial weights)."""
        if self.cfg.train.schedule != "async":
            return self.steps, self.steps
        return (self.steps + 1, self.steps + 1) if self.steps else (0, 1)

    def serves(self, step: int, what: str) -> None:
        """Raises unless its weights serve micro-batches of `step` (`at`, for micro-batches)."""
        low, high = self.serving()
        if self.cfg.train.schedule != "async":
            self.at(step, what)
        elif not low <= step <= high:
            raise RemoteError(
                f"stage {self.place.stage} peer's weights serve step {high}, {what} of step {step}", pb.UNAVAILABLE
            )

    # ---- transitions -----------------------------------------------------------------------------

    def started(self, session: tuple, runtime, tied: list) -> None:
        """A new trainer session built the stage afresh."""
        self.stop_joining()
        self.joined = None
        self.cfg = self.configured
        self.runtime, self.session, self.tied, self.steps = runtime, session, list(tied), 0
        self.generation += 1
        self.attempts.clear()
        self._weights_serve()

    def follow(self, joining) -> None:
        """Set up mid-run: it catches up (`joining`) before it serves."""
        self.joining = joining

    def caught_up(self, step: int, state_bytes: int, seconds: float) -> None:
        """Its downloaded state is installed: it serves from now on."""
        self.joining = None
        self.joined = (step, state_bytes, seconds)

    def stop_joining(self) -> None:
        joining, self.joining = self.joining, None
        if joining is not None:
            joining.cancel()

    def stepped(self) -> None:
        self.steps += 1
        self._weights_serve()

    def _weights_serve(self) -> None:
        """dc's weights of the steps the stage's weights now serve (swarm.engine.versions `serves`)."""
        versions = self.runtime.versions
        if versions is not None:
            low, high = self.serving()
            versions.serves(range(low, high + 1), self.runtime.module)

    def restored(self, cfg: ExperimentConfig, step: int) -> None:
        """A checkpoint or copy of `step` was installed, with `cfg`'s codecs. With an asynchronous
        schedule its kept gradients (the step before's) are held again, applied when that step's
        decision comes, as if its micro-batches had just run here."""
        self.cfg = cfg
        self.steps = self.drained(step)
        self.generation += 1
        self.attempts.clear()
        self.counted = []
        delay = self.runtime.delay
        if delay is not None and delay.kept is not None:
            kept, delay.kept = delay.kept, None  # a swarm's stage holds its gradients per micro-batch
            then, delay.then = delay.then, None  # ... and dc's weights per open step (swarm.engine.versions)
            self.runtime.hold_kept(step - 1, cfg.train.micro_batches, kept)
            if self.runtime.versions is not None:
                self.runtime.versions.hold_weights(step - 1, then)
            self.count(step - 1)
        self._weights_serve()

    def nothing_unshared(self) -> bool:
        """Whether every gradient it holds is in its replicas' sums too: none held, or only an
        asynchronous step's already summed with its replicas (stage.combine), which a leaver may
        take away without the run noticing (stage.leaving)."""
        runtime = self.runtime
        return all(key[1] in runtime.combined for key in runtime.held)  # a key is (mode, step, index)

    def keep_tied(self, step: int, totals: dict[str, torch.Tensor]) -> None:
        """`step`'s tied parameters' totals, applied in place of this stage's part (asynchronous
        schedule: from its held round, or a joiner's download)."""
        key = (self.generation, step)
        self.tied_totals = {k: v for k, v in self.tied_totals.items() if k[0] == key[0] and k[1] > step - 2}
        self.tied_totals[key] = totals

    def tied_sums(self, step: int) -> dict[str, torch.Tensor]:
        """`keep_tied`'s totals of `step` (none without tied parameters)."""
        return self.tied_totals.get((self.generation, step), {})

    def count(self, step: int) -> None:
        """Its held gradients of `step` were counted (asynchronous schedule): its decision applies them."""
        self.counted = [*self.counted, (self.generation, step)][-2:]

    def switched(self, cfg: ExperimentConfig) -> None:
        """Adaptive compression: `cfg`'s codecs from the next step on."""
        self.cfg = cfg

    def leave(self) -> None:
        self.leaving = True

    def left_session(self) -> None:
        """Out of the run until its trainer sets it up again."""
        self.stop_joining()
        self.runtime = None
        self.session = None


def leave_session(place: StagePlace, state: StageState, peer: PeerServices, reason: str) -> None:
    """Out of the run until its trainer sets it up again (as a joiner): behind the run, or its join failed."""
    peer.events.add(
        "leave", f"stage {place.stage} of run {place.run_id!r} leaves the session: {reason}", logging.WARNING, log
    )
    state.left_session()
    peer.changed()


@dataclass
class StageMeters:
    clock: ComputeClock = field(default_factory=ComputeClock)  # training compute (throughput bounds)
    occupied: Busy = field(default_factory=Busy)  # seconds with a micro-batch in the stage (the rest: idle)
    throughput: float = 0.0  # samples/s, a moving average (its DHT record: routers prefer faster peers)
    queue: int = 0  # micro-batches inside the stage now
    peak_queue: int = 0
    processed: int = 0
    set_up_at: float = 0.0  # when it was last set up (monotonic): a joiner's first micro-batch is timed from it
    serving_since: float = 0.0  # when it was first set up: its idle seconds count from then
    first_batch_s: float | None = None  # seconds from being set up to the first micro-batch
    last_s: float = 0.0  # when the last micro-batch left it (monotonic): its run is not quiet

    def measure(self, batch: MicroBatch, seconds: float, policy: RoutingPolicy) -> None:
        if seconds > 0:
            self.throughput = policy.throughput(self.throughput, batch.size / seconds)

    def set_up(self) -> None:
        self.set_up_at, self.first_batch_s = time.monotonic(), None
        self.serving_since = self.serving_since or self.set_up_at

    def entered(self) -> None:
        self.queue += 1
        self.peak_queue = max(self.peak_queue, self.queue)
        self.occupied.enter()

    def left(self, processed: bool) -> None:
        self.queue -= 1
        self.last_s = time.monotonic()
        self.occupied.leave()
        if processed:
            self.processed += 1

    def first_batch(self, joined: bool, stage: int) -> None:
        if self.first_batch_s is None:
            self.first_batch_s = time.monotonic() - self.set_up_at
            if joined:
                log.info("stage %d: first micro-batch %.1fs after it was set up to join", stage, self.first_batch_s)
