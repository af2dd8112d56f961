"""Every timeout and limit of the hivemind transport, in one object of a few sections (documented
in docs/settings.md).

A peer's `SwarmNode` carries its `Settings`; everything the peer does (calls, the stage server,
routing, announcing) reads them from there. The peers' command lines set the few a user tunes
(`--timeout`, `--max_payload_mb`, `--wait`); the rest are defaults that hold on home links and
loopback alike. `Settings.of(name=value, ...)` sets any of them by name, whatever its section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from protocols.framing import MAX_PAYLOAD_BYTES
from protocols.wire import DecodeLimits


def _positive(section) -> None:
    for name, value in vars(section).items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"setting {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Calls:
    # A micro-batch's whole chain (this stage, the stages after it, and back) must answer within
    # this; the trainer gives it to stage 0, each stage passes on what is left of it. Step rounds,
    # setups and checkpoint transfers get as long.
    call_timeout_s: float = 120.0
    # The trainer waits this much longer than the chain's budget, so a stage's own timeout error
    # (a one-line reason) arrives before the trainer gives up on the stream.
    reply_grace_s: float = 5.0
    # A status call from peers.status (the trainer's own status reads get call_timeout_s: its
    # results count the bytes they report).
    info_timeout_s: float = 10.0
    # A joiner's download of its stage's state (a whole stage file over a home link).
    state_timeout_s: float = 600.0
    # A stage answers within the budget it was given less this, so its own one-line error (a
    # timeout downstream) reaches the caller before the caller gives up on the stream ...
    budget_margin_s: float = 0.5
    # ... and never gets less than this for a call (a budget used up still lets a reply through).
    min_budget_s: float = 0.1

    def __post_init__(self) -> None:
        _positive(self)


@dataclass(frozen=True)
class Retries:
    """swarm.transport.hivemind.net.retry"""

    attempts: int = 3  # tries of a micro-batch (on other peers) or a step round before giving up
    backoff_s: float = 0.2  # a step round's n-th retry waits n times this
    ban_s: float = 5.0  # a peer that failed a call is not chosen for this long ...
    ban_growth: float = 2.0  # ... times this for every failure in a row ...
    ban_max_s: float = 300.0  # ... up to this

    def __post_init__(self) -> None:
        _positive(self)


@dataclass(frozen=True)
class Streams:
    # A caller reuses a stream idle for less than this; the server closes streams idle for
    # `server_idle_s`, so a caller never writes to a stream the server is closing.
    keep_idle_s: float = 20.0
    server_idle_s: float = 60.0
    # A failed exchange sends its end marker and waits this long for the server to close the stream.
    end_wait_s: float = 2.0
    # A server that refused a request reads what is left of it this long before closing the stream
    # (closing under a caller still writing would cut the error reply short).
    drain_s: float = 10.0
    # Seconds between two messages of one payload: a slow link may take long for a whole
    # payload, a silent peer is noticed.
    read_timeout_s: float = 60.0
    sending_per_neighbour: int = 1  # payloads in transfer at once to one neighbour (calls.Sending)
    # Link order (swarm.transport.hivemind.flow.ordering): a message of a link epoch this end has not
    # seen waits this long for the epoch's first message; past it, this end lost the link (it
    # restarted) and says so.
    link_grace_s: float = 10.0

    def __post_init__(self) -> None:
        _positive(self)


@dataclass(frozen=True)
class Limits:
    max_micro_batch_bytes: int = 1 << 30  # one boundary's activations or gradients (--max_payload_mb)
    max_payload_bytes: int = MAX_PAYLOAD_BYTES  # stage checkpoints and the step's gradients
    # Requests one peer may have in progress at a stage server at once (the trainer's in-flight
    # micro-batches are far fewer); more are refused at once, so a flood costs its sender only.
    max_requests_per_sender: int = 64
    # Micro-batch payload bytes one peer may have at a stage server at once (declared in the head,
    # counted before the payload is read): a member cannot fill the peer's memory.
    max_held_bytes_per_sender: int = 1 << 31
    # CPU one peer's refused requests may cost a stage server (swarm.transport.hivemind.net.cpu):
    # this share of a core over any `refusal_cpu_window_s`; a sender over it is banned, as one of a
    # malformed payload is (retries.ban_s ...). An honest peer's refusals (a micro-batch of a past
    # step, a stream cut short) cost a checksum of its payload at most.
    refusal_cpu_share: float = 0.1
    refusal_cpu_window_s: float = 10.0
    # Admissions to an open run (anyone may announce a stage): a stage takes at most this many new
    # peers at one step boundary, has at most this many still catching up, and at most this many
    # members; the others wait for a later boundary. A burst of joiners (a Sybil flood of records)
    # then costs the run one state download per stage and step, not one per record.
    joins_per_step: int = 2
    max_joining: int = 4
    max_peers_per_stage: int = 32

    def __post_init__(self) -> None:
        _positive(self)

    @property
    def decode_limits(self) -> DecodeLimits:
        """What a micro-batch's activations or gradient may decode to: every tensor whose dense
        form fits `max_micro_batch_bytes` in a 16-bit float (an exact fp16/bf16 payload), so the
        byte limit is the one knob; a compressed payload of a few bytes cannot describe more."""
        return DecodeLimits(max_elements=self.max_micro_batch_bytes // 2, max_payload_bytes=self.max_micro_batch_bytes)


@dataclass(frozen=True)
class Dht:
    announce_every_s: float = 5.0  # a stage peer re-announces its record this often ...
    record_ttl_s: float = 15.0  # ... and a record expires this long after it was stored
    lookup_every_s: float = 5.0  # a router looks a stage's peers up again after this
    # A lookup that finds nobody keeps the last non-empty answer this long: over a saturated slow
    # link the DHT's requests can time out while the peers serve on.
    lookup_keep_s: float = 60.0
    setup_wait_s: float = 60.0  # the trainer waits this long for every stage to have a peer (--wait)

    def __post_init__(self) -> None:
        _positive(self)


@dataclass(frozen=True)
class Routing:
    """swarm.transport.hivemind.routing.router.RoutingPolicy"""

    # A caller keeps sending to the peer it uses (its link state) unless another scores this many times higher.
    route_keep_factor: float = 2.0
    # The throughput a peer announces: a moving average of its micro-batches' samples/s, the newest weighing this.
    throughput_smoothing: float = 0.1

    def __post_init__(self) -> None:
        _positive(self)
        if self.throughput_smoothing > 1:
            raise ValueError(f"setting throughput_smoothing must be at most 1, got {self.throughput_smoothing!r}")


@dataclass(frozen=True)
class Settings:
    calls: Calls = field(default_factory=Calls)
    retries: Retries = field(default_factory=Retries)
    streams: Streams = field(default_factory=Streams)
    limits: Limits = field(default_factory=Limits)
    dht: Dht = field(default_factory=Dht)
    routing: Routing = field(default_factory=Routing)

    @classmethod
    def of(cls, **values) -> Settings:
        """Settings with `values` (setting name -> value, in whichever section it is), the rest defaults."""
        sections = {}
        for name, section in SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section)}
            sections[name] = section(**{key: values.pop(key) for key in list(values) if key in names})
        if values:
            raise ValueError(f"unknown setting(s): {', '.join(sorted(values))}")
        return cls(**sections)


SECTIONS = {"calls": Calls, "retries": Retries, "streams": Streams, "limits": Limits, "dht": Dht, "routing": Routing}
