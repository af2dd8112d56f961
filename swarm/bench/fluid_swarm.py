"""The fluid model of one synchronous step (swarm.bench.fluid) over a swarm: every stage served by
one or more replicas, each with its own access link (up and down rate, one-way delay) and compute.

A micro-batch goes trainer -> a replica of stage 0 -> a replica of stage 1 ... and its gradients
come back the same way (a sender awaits its receiver's reply: swarm.transport.hivemind.routing
.handoff). Each sender chooses the next stage's replica as the trainer's routing policy does
(`RoutingPolicy` in swarm.transport.hivemind.routing.router): a replica's score is its throughput
over one plus its queue (the micro-batches inside it) and the micro-batches this sender awaits of
it (on a link whose codecs keep state, error feedback, the queue only); the best wins, ties broken
at random; on a stateful link a sender keeps the replica it chose last unless another scores
`keep_factor` times higher (`Handoff.sticky`). The throughput a replica announces is a moving
average of its micro-batches' rates through its own compute (forward and backward seconds, waiting
for its computing thread included, not for links). Throughputs and queues are read as the DHT has
them (swarm.bench.fluid_records), up to `announce_s + lookup_s` old; a sender's own awaited count
is always fresh. Stale queues
and stickiness together made a sender pile micro-batches on one replica while another, whose record
still showed an old queue, idled (measured in the lab: docs/bench/scale.md); senders on stateless
links no longer keep their last replica.

Links: a transfer from A to B crosses A's up link and B's down link, which share their rates among
the transfers crossing them max-min fairly in proportion to the transfers' sizes (as the peers'
pacing does); an infinite rate is not a constraint. A payload arrives the sender's one-way delay
after its last byte left. After the last micro-batch, each of the step's `round_trips` goes from the
trainer to every peer and back: the slowest pair's two delays.

    step = SwarmStep(stages=((Replica(Link(100e6, 100e6, 0.05), 0.01),) * 2,) * 4, ...)
    simulate_swarm(step).step_s, simulate_swarm(step).routed   # seconds; micro-batches per replica
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.bench.fluid_records import StaleRecords

_EPS = 1e-12
TRAINER = "trainer"


@dataclass(frozen=True)
class Link:
    """One process's access link: bits/s each direction (inf: not shaped) and the one-way delay of
    what it sends."""

    up_bits: float
    down_bits: float = math.inf
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.up_bits <= 0 or self.down_bits <= 0 or self.delay_s < 0:
            raise ValueError(f"a link needs positive rates and a delay >= 0, got {self}")


@dataclass(frozen=True)
class Replica:
    link: Link
    compute_s: float  # per micro-batch, forward or backward (each)


@dataclass(frozen=True)
class Payloads:
    """Bytes per micro-batch: boundary j = stage j -> j + 1 forward, back backward; the trainer's input."""

    forward_bytes: Sequence[float]
    backward_bytes: Sequence[float]
    input_bytes: float = 0.0


@dataclass(frozen=True)
class Schedule:
    micro_batches: int
    in_flight: int  # micro-batches the trainer keeps in the pipeline
    sending: int = 1  # payloads in transfer at once per neighbour (sending_per_neighbour)
    round_trips: int = 0  # the step's rounds after its last micro-batch (trainer -> peers -> trainer)


@dataclass(frozen=True)
class Routing:
    stateful: bool = False  # the links' codecs keep state: a sender keeps to one replica (see module doc)
    keep_factor: float = 2.0  # settings.routing.route_keep_factor
    smoothing: float = 0.1  # settings.routing.throughput_smoothing
    seed: int = 0  # ties between equal scores are broken at random
    announce_s: float = 5.0  # settings.dht.announce_every_s (0: records always current)
    lookup_s: float = 5.0  # settings.dht.lookup_every_s (0: a sender reads the records at every choice)


@dataclass(frozen=True)
class SwarmStep:
    stages: Sequence[Sequence[Replica]]
    payloads: Payloads
    schedule: Schedule
    trainer: Link
    routing: Routing = Routing()

    def __post_init__(self) -> None:
        n = len(self.stages)
        if n < 2:
            raise ValueError(f"the model needs at least 2 stages, got {n}")
        if any(not replicas for replicas in self.stages):
            raise ValueError("every stage needs at least one replica")
        p = self.payloads
        if len(p.forward_bytes) != n - 1 or len(p.backward_bytes) != n - 1:
            raise ValueError(
                f"forward_bytes and backward_bytes need {n - 1} values (one per boundary), got "
                f"{len(p.forward_bytes)} and {len(p.backward_bytes)}"
            )
        s = self.schedule
        if min(s.micro_batches, s.in_flight, s.sending) < 1:
            raise ValueError("micro_batches, in_flight and sending must be positive")
        if s.round_trips < 0:
            raise ValueError("round_trips cannot be negative")

    def name(self, stage: int, replica: int) -> str:
        return f"stage{stage}" if len(self.stages[stage]) == 1 else f"stage{stage}.{replica}"


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
    routed: Mapping[str, int] = field(default_factory=dict)  # micro-batches each stage peer ran

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
    flows: Sequence[tuple[str, ...]], capacity: float | Mapping[str, float], weights: Sequence[float] | None = None
) -> list[float]:
    """Weighted max-min fair rates of flows, each given as the links it crosses (each of `capacity`,
    or of its own in a mapping): on a link, unsaturated flows get rates in proportion to their
    weights (default: equal). Every flow must cross at least one link.

    The bottleneck form of progressive filling: the link whose capacity left per unit of weight is
    the lowest fixes its flows at that level; their rates leave the other links they cross (whose
    levels can only rise), and so on: one heap of links, stale entries pushed again."""
    weights = weights or [1.0] * len(flows)
    cap = (lambda link: capacity[link]) if isinstance(capacity, Mapping) else (lambda link: capacity)
    left: dict[str, float] = {}
    users: dict[str, list[int]] = defaultdict(list)
    for i, links in enumerate(flows):
        for link in links:
            left[link] = cap(link)
            users[link].append(i)
    rates: list[float | None] = [None] * len(flows)

    def level(link: str) -> float | None:
        """Capacity left per unit of the weight still to fix on `link` (None: nothing left to fix)."""
        weight = sum(weights[i] for i in users[link] if rates[i] is None)
        return max(left[link], 0.0) / weight if weight > 0 else None

    heap = [(level(link), link) for link in users]
    heapq.heapify(heap)
    while heap:
        before, link = heapq.heappop(heap)
        now = level(link)
        if now is None:
            continue
        if now > before:  # flows fixed elsewhere left it more than it had then: its turn comes later
            heapq.heappush(heap, (now, link))
            continue
        for i in users[link]:
            if rates[i] is None:
                rates[i] = now * weights[i]
                for other in flows[i]:
                    left[other] -= rates[i]
    return [rate or 0.0 for rate in rates]


class _Step:
    def __init__(self, m: SwarmStep) -> None:
        self.m, self.t = m, 0.0
        self.links: dict[str, Link] = {TRAINER: m.trainer}
        self.compute_s: dict[str, float] = {}
        for s, replicas in enumerate(m.stages):
            for r, replica in enumerate(replicas):
                self.links[m.name(s, r)] = replica.link
                self.compute_s[m.name(s, r)] = replica.compute_s
        self.capacity = {f"{p} up": link.up_bits / 8 for p, link in self.links.items()}
        self.capacity |= {f"{p} down": link.down_bits / 8 for p, link in self.links.items()}
        self.transfers: list[list] = []  # [bytes left, sender, receiver, callback, size]
        self.waiting: dict[tuple[str, str], deque] = defaultdict(deque)
        self.in_transfer: dict[tuple[str, str], int] = defaultdict(int)
        self.queued: set[tuple[str, str]] = set()  # pairs with payloads waiting to go
        self.changed = True  # the transfers changed since their rates were shared out
        self.events: list = []
        self.order = itertools.count()
        self.free_at: dict[str, float] = defaultdict(float)
        self.tickets: dict[str, int] = defaultdict(int)  # forward order per replica: its backward order
        self.back_ready: dict[str, dict[int, tuple[float, Callable]]] = defaultdict(dict)
        self.back_next: dict[str, int] = defaultdict(int)
        self.awaited: dict[tuple[str, str], int] = defaultdict(int)  # (sender, receiver): replies awaited
        self.inside: dict[str, int] = defaultdict(int)  # micro-batches in a replica (its queue)
        self.sticky: dict[str, str] = {}
        self.records = StaleRecords(
            m.routing.announce_s, m.routing.lookup_s, lambda n: (self.inside[n], self.throughput[n])
        )
        self.throughput: dict[str, float] = defaultdict(float)  # what each replica announces (0: not measured)
        self.routed: dict[str, int] = dict.fromkeys(self.compute_s, 0)
        self.rng = random.Random(m.routing.seed)
        self.admitted = self.done = 0
        self.log: list[Transfer] = []

    def later(self, when: float, callback) -> None:
        heapq.heappush(self.events, (when, next(self.order), callback))

    def compute(self, peer: str, callback) -> None:
        start = max(self.t, self.free_at[peer])
        self.free_at[peer] = start + self.compute_s[peer]
        self.later(self.free_at[peer], callback)

    def send(self, sender: str, receiver: str, nbytes: float, callback) -> None:
        queued = self.t

        def out() -> None:  # the last byte left: it arrives a delay later
            self.log.append(Transfer(sender, receiver, queued, self.t))
            delay = self.links[sender].delay_s
            if delay:
                self.later(self.t + delay, callback)
            else:
                callback()

        self.waiting[(sender, receiver)].append((nbytes, out))
        self.queued.add((sender, receiver))
        self.start_waiting()

    def start_waiting(self) -> None:
        for pair in sorted(self.queued):  # in a fixed order: the model is deterministic
            queue = self.waiting[pair]
            while queue and self.in_transfer[pair] < self.m.schedule.sending:
                nbytes, callback = queue.popleft()
                self.in_transfer[pair] += 1
                self.transfers.append([nbytes, *pair, callback, nbytes])
                self.changed = True
            if not queue:
                self.queued.discard(pair)

    def choose(self, sender: str, stage: int) -> str:
        """The replica of `stage` that `sender` hands its next micro-batch to (module doc)."""
        names = [self.m.name(stage, r) for r in range(len(self.m.stages[stage]))]
        if len(names) == 1:
            return names[0]
        seen = self.records.read(sender, names, self.t)
        measured = sorted(rate for _, rate in seen.values() if rate > 0)
        typical = measured[len(measured) // 2] if measured else 1.0
        stateful = self.m.routing.stateful

        def score(n: str) -> float:
            queue, rate = seen[n]
            return (rate or typical) / (1 + queue + (0 if stateful else self.awaited[(sender, n)]))

        best = max(names, key=lambda n: (score(n), self.rng.random()))
        kept = self.sticky.get(sender) if stateful else None
        if kept is not None and self.m.routing.keep_factor * score(kept) >= score(best):
            best = kept
        self.sticky[sender] = best
        return best

    def hand_on(self, sender: str, stage: int, nbytes: float, returned: Callable) -> None:
        """`sender` sends a micro-batch's activations (or the trainer its input) to a replica of
        `stage`; `returned()` when its gradients (its reply) are back at the sender."""
        receiver = self.choose(sender, stage)
        self.awaited[(sender, receiver)] += 1
        self.inside[receiver] += 1
        self.routed[receiver] += 1

        def back() -> None:
            self.awaited[(sender, receiver)] -= 1
            returned()

        def arrived() -> None:
            ticket, at = self.tickets[receiver], self.t
            self.tickets[receiver] += 1
            self.compute(receiver, lambda: self.forward_done(stage, receiver, sender, (ticket, back, self.t - at)))

        self.send(sender, receiver, nbytes, arrived)

    def forward_done(self, stage: int, peer: str, sender: str, mb: tuple[int, Callable, float]) -> None:
        """`mb`: the micro-batch's place in `peer`'s forward order, what to call when its gradients
        are back at `sender`, and the seconds its forward took there (waiting for the thread included)."""
        if stage == len(self.m.stages) - 1:
            self.backward_arrived(peer, sender, stage, mb)  # the loss's gradient is here
            return
        self.hand_on(
            peer,
            stage + 1,
            self.m.payloads.forward_bytes[stage],
            lambda: self.backward_arrived(peer, sender, stage, mb),
        )

    def backward_arrived(self, peer: str, sender: str, stage: int, mb: tuple[int, Callable, float]) -> None:
        """A gradient reached `peer`: backward there in its forward order, then the gradient goes back
        and the peer's throughput is measured as the real one is (its forward and backward seconds)."""
        ticket, back, forward_s = mb
        nbytes = self.m.payloads.backward_bytes[stage - 1] if stage else 0.0  # stage 0's reply is empty
        self.back_ready[peer][ticket] = (forward_s, lambda: self.send(peer, sender, nbytes, back))
        while self.back_next[peer] in self.back_ready[peer]:
            forward_s, then = self.back_ready[peer].pop(self.back_next[peer])
            self.back_next[peer] += 1
            self.inside[peer] -= 1
            self.compute(peer, self.measured(peer, forward_s, self.t, then))

    def measured(self, peer: str, forward_s: float, started: float, then: Callable) -> Callable:
        """`then`, after `peer`'s throughput takes in a micro-batch whose backward started at `started`
        (RoutingPolicy.throughput: a moving average, in micro-batches/s here)."""

        def done() -> None:
            seconds = forward_s + self.t - started
            if seconds > 0:
                rate, old = 1 / seconds, self.throughput[peer]
                smoothing = self.m.routing.smoothing
                self.throughput[peer] = rate if old == 0 else (1 - smoothing) * old + smoothing * rate
            then()

        return done

    def finished(self) -> None:
        self.done += 1
        if self.admitted < self.m.schedule.micro_batches:
            self.admit()

    def admit(self) -> None:
        self.admitted += 1
        self.hand_on(TRAINER, 0, self.m.payloads.input_bytes, self.finished)

    def rates(self) -> list[float]:
        flows = []
        for t in self.transfers:
            up, down = f"{t[1]} up", f"{t[2]} down"
            flows.append(tuple(link for link in (up, down) if math.isfinite(self.capacity[link])))
        shaped = [i for i, f in enumerate(flows) if f]
        rates = [math.inf] * len(flows)
        fair = max_min_rates(
            [flows[i] for i in shaped], self.capacity, [max(self.transfers[i][4], _EPS) for i in shaped]
        )
        for i, rate in zip(shaped, fair, strict=True):
            rates[i] = rate
        return rates

    def run(self) -> FluidResult:
        for _ in range(min(self.m.schedule.in_flight, self.m.schedule.micro_batches)):
            self.admit()
        rates: list[float] = []
        while self.done < self.m.schedule.micro_batches:
            if self.changed:
                rates, self.changed = self.rates(), False
            until_transfer = min(
                (t[0] / r for t, r in zip(self.transfers, rates, strict=True) if r > 0), default=math.inf
            )
            until_event = self.events[0][0] - self.t if self.events else math.inf
            dt = max(min(until_transfer, until_event), 0.0)
            if dt == math.inf:
                raise RuntimeError("the fluid model stalled (nothing in transfer, nothing scheduled)")
            for transfer, rate in zip(self.transfers, rates, strict=True):
                transfer[0] = 0.0 if rate == math.inf else transfer[0] - rate * dt
            self.t += dt
            arrived = [t for t in self.transfers if t[0] <= _EPS * max(t[4], 1.0)]
            if arrived:
                kept = [(t, r) for t, r in zip(self.transfers, rates, strict=True) if t[0] > _EPS * max(t[4], 1.0)]
                self.transfers, rates = [t for t, _ in kept], [r for _, r in kept]
                self.changed = True
            for _, sender, receiver, callback, _ in arrived:
                self.in_transfer[(sender, receiver)] -= 1  # the bytes are out: the next payload may go
                callback()
            while self.events and self.events[0][0] <= self.t + _EPS:
                heapq.heappop(self.events)[2]()
            self.start_waiting()
        farthest = max(link.delay_s for peer, link in self.links.items() if peer != TRAINER)
        rounds = self.m.schedule.round_trips * (self.m.trainer.delay_s + farthest)
        return FluidResult(self.t + rounds, tuple(self.log), dict(self.routed))


def simulate_swarm(step: SwarmStep) -> FluidResult:
    return _Step(step).run()
