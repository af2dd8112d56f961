"""What the pipeline's schedule allows on ideal links: a fluid model of one synchronous step.

The link bound (swarm.bench.bounds) assumes the busiest link never idles. A real step cannot
reach it: the pipeline fills and drains, and a link carrying both waves waits on the other. This
model replays the swarm's schedule (micro-batches admitted `in_flight` at a time by the trainer,
at most `sending` payloads in transfer per neighbour, one compute thread per stage, backward in
forward order) on access links that share their rate among the transfers crossing them (a
transfer from A to B uses A's up and B's down link) max-min fairly in proportion to the transfers'
sizes, as the peers' pacing shares them (swarm.transport.hivemind.flow.pacing: payloads written together finish
together), with no loss or protocol overhead. Every hop (a payload, a reply to the trainer) arrives
`delay_s` after its last byte left (the one-way latency; the link is free again as soon as the
bytes are out), and after the last micro-batch the step's `round_trips` from the trainer to every
stage and back (the synchronous step's rounds) each cost two delays. Its step time is what a perfect
network of that rate and latency would give this schedule; a measured step much slower than that
points at the transport, not the schedule.

    model = StepModel(stages=4, micro_batches=64, in_flight=16, sending=1,
                      forward_bytes=[2**20] * 3, backward_bytes=[2**20] * 3,
                      compute_s=[0.01] * 4, rate_bits=100e6)
    simulate(model).step_s       # seconds of one step
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-12


@dataclass(frozen=True)
class StepModel:
    stages: int
    micro_batches: int
    in_flight: int
    sending: int  # payloads in transfer at once per neighbour (the transport settings' sending_per_neighbour)
    forward_bytes: Sequence[float]  # per micro-batch, boundary j = stage j -> j + 1
    backward_bytes: Sequence[float]
    compute_s: Sequence[float]  # per micro-batch and stage, forward or backward (each)
    rate_bits: float  # every process's access link, each direction
    input_bytes: float = 0.0  # trainer -> stage 0, per micro-batch
    download_limited: bool = True  # False: only what a process sends is shaped (in-process shaping)
    delay_s: float = 0.0  # one way, every hop
    round_trips: int = 0  # of the step's rounds after its last micro-batch (trainer -> stages -> trainer)

    def __post_init__(self) -> None:
        if self.stages < 2:
            raise ValueError(f"the model needs at least 2 stages, got {self.stages}")
        for name, values, n in (
            ("forward_bytes", self.forward_bytes, self.stages - 1),
            ("backward_bytes", self.backward_bytes, self.stages - 1),
            ("compute_s", self.compute_s, self.stages),
        ):
            if len(values) != n:
                raise ValueError(
                    f"{name} needs {n} values (one per {'boundary' if n < self.stages else 'stage'}), got {len(values)}"
                )
        if min(self.micro_batches, self.in_flight, self.sending) < 1 or self.rate_bits <= 0:
            raise ValueError("micro_batches, in_flight, sending and rate_bits must be positive")
        if self.delay_s < 0 or self.round_trips < 0:
            raise ValueError("delay_s and round_trips cannot be negative")


@dataclass(frozen=True)
class Transfer:
    """One payload of the modelled step: queued by `sender` at `queued` s, its last byte out at
    `done` s (it arrives a delay later)."""

    sender: str
    receiver: str
    queued: float
    done: float


@dataclass(frozen=True)
class FluidResult:
    step_s: float
    transfers: tuple[Transfer, ...] = ()  # in the order their last bytes left

    def marks(self) -> dict[str, tuple[float, float]]:
        """Per sender: (its first payload queued, its last payload's last byte out), in seconds from
        the step's start: what `python -m swarm timeline --marks` measures on a real step."""
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for t in self.transfers:
            first[t.sender] = min(first.get(t.sender, t.queued), t.queued)
            last[t.sender] = max(last.get(t.sender, t.done), t.done)
        return {sender: (first[sender], last[sender]) for sender in sorted(first)}


def max_min_rates(
    flows: Sequence[tuple[str, ...]], capacity: float, weights: Sequence[float] | None = None
) -> list[float]:
    """Weighted max-min fair rates of flows, each given as the links it crosses (all of `capacity`):
    on a link, unsaturated flows get rates in proportion to their weights (default: equal)."""
    weights = weights or [1.0] * len(flows)
    rates = [0.0] * len(flows)
    active = set(range(len(flows)))
    left: dict[str, float] = defaultdict(lambda: capacity)
    while active:
        users: dict[str, list[int]] = defaultdict(list)
        for i in active:
            for link in flows[i]:
                users[link].append(i)
        share = min(left[link] / sum(weights[i] for i in ix) for link, ix in users.items())
        for i in active:
            rates[i] += share * weights[i]
        for link, ix in users.items():
            left[link] -= share * sum(weights[i] for i in ix)
        saturated = {i for link, ix in users.items() if left[link] <= _EPS * capacity for i in ix}
        active -= saturated
    return rates


class _Step:
    def __init__(self, m: StepModel) -> None:
        self.m, self.t = m, 0.0
        self.capacity = m.rate_bits / 8
        self.transfers: list[list] = []  # [bytes left, sender, receiver, callback, size]
        self.waiting: dict[tuple[str, str], deque] = defaultdict(deque)
        self.in_transfer: dict[tuple[str, str], int] = defaultdict(int)
        self.events: list = []
        self.order = itertools.count()
        self.free_at: dict[int, float] = defaultdict(float)
        self.back_ready: dict[int, set[int]] = defaultdict(set)
        self.back_next: dict[int, int] = defaultdict(int)
        self.admitted = self.done = 0
        self.log: list[Transfer] = []

    def later(self, when: float, callback) -> None:
        heapq.heappush(self.events, (when, next(self.order), callback))

    def compute(self, stage: int, callback) -> None:
        start = max(self.t, self.free_at[stage])
        self.free_at[stage] = start + self.m.compute_s[stage]
        self.later(self.free_at[stage], callback)

    def send(self, sender: str, receiver: str, nbytes: float, callback) -> None:
        queued = self.t

        def arrived() -> None:  # a delay after its last byte left
            self.log.append(Transfer(sender, receiver, queued, self.t - self.m.delay_s))
            callback()

        self.waiting[(sender, receiver)].append((nbytes, arrived))
        self.start_waiting()

    def start_waiting(self) -> None:
        for pair, queue in self.waiting.items():
            while queue and self.in_transfer[pair] < self.m.sending:
                nbytes, callback = queue.popleft()
                self.in_transfer[pair] += 1
                self.transfers.append([nbytes, *pair, callback, nbytes])

    def admit(self) -> None:
        mb = self.admitted
        self.admitted += 1
        self.send("trainer", "stage0", self.m.input_bytes, lambda: self.compute(0, lambda: self.forward_done(0, mb)))

    def forward_done(self, stage: int, mb: int) -> None:
        if stage == self.m.stages - 1:
            self.backward_arrived(stage, mb)  # the loss's gradient is here
            return
        self.send(
            f"stage{stage}",
            f"stage{stage + 1}",
            self.m.forward_bytes[stage],
            lambda: self.compute(stage + 1, lambda: self.forward_done(stage + 1, mb)),
        )

    def backward_arrived(self, stage: int, mb: int) -> None:
        """A gradient reached `stage`: backward there in forward order, then the gradient goes up."""
        self.back_ready[stage].add(mb)
        while self.back_next[stage] in self.back_ready[stage]:
            n = self.back_next[stage]
            self.back_ready[stage].discard(n)
            self.back_next[stage] += 1
            self.compute(
                stage,
                (lambda: self.send("stage0", "trainer", 0.0, self.finished))  # its reply: the trainer admits the next
                if stage == 0
                else lambda s=stage, k=n: self.send(
                    f"stage{s}", f"stage{s - 1}", self.m.backward_bytes[s - 1], lambda: self.backward_arrived(s - 1, k)
                ),
            )

    def finished(self) -> None:
        self.done += 1
        if self.admitted < self.m.micro_batches:
            self.admit()

    def run(self) -> FluidResult:
        for _ in range(min(self.m.in_flight, self.m.micro_batches)):
            self.admit()
        while self.done < self.m.micro_batches:
            flows = [
                (f"{t[1]} up", f"{t[2]} down") if self.m.download_limited else (f"{t[1]} up",) for t in self.transfers
            ]
            rates = max_min_rates(flows, self.capacity, [max(t[4], _EPS) for t in self.transfers]) if flows else []
            until_transfer = min(
                (t[0] / r for t, r in zip(self.transfers, rates, strict=True) if r > 0), default=float("inf")
            )
            until_event = self.events[0][0] - self.t if self.events else float("inf")
            dt = max(min(until_transfer, until_event), 0.0)
            if dt == float("inf"):
                raise RuntimeError("the fluid model stalled (nothing in transfer, nothing scheduled)")
            for transfer, rate in zip(self.transfers, rates, strict=True):
                transfer[0] -= rate * dt
            self.t += dt
            arrived = [t for t in self.transfers if t[0] <= _EPS * self.capacity]
            self.transfers = [t for t in self.transfers if t[0] > _EPS * self.capacity]
            for _, sender, receiver, callback, _ in arrived:
                self.in_transfer[(sender, receiver)] -= 1  # the bytes are out: the next payload may go
                if self.m.delay_s:
                    self.later(self.t + self.m.delay_s, callback)
                else:
                    callback()
            while self.events and self.events[0][0] <= self.t + _EPS:
                heapq.heappop(self.events)[2]()
            self.start_waiting()
        return FluidResult(self.t + 2 * self.m.delay_s * self.m.round_trips, tuple(self.log))


def simulate(model: StepModel) -> FluidResult:
    return _Step(model).run()
