"""The swarm as a table: every run's stages, their peers, addresses, throughput, bytes per link,
their compression ratio, the rate payloads arrive at and the codecs of each end, round-trip time,
and when each peer last announced itself (for `python -m peers.status`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from hivemind.utils import get_dht_time

from protocols import stage_pb2 as pb
from protocols.stubs import STUBS
from swarm.rates import format_rate
from swarm.transport.hivemind.dht.announce import discover, list_runs
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.events import KEEP, Event
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.trust.admissions import Admissions


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"


@dataclass
class Announcement:
    """What a peer's DHT record says of it, read without asking the peer (the record outlives a peer
    that left, a while)."""

    addrs: list[str]
    throughput: float
    queue: int
    ready: bool
    last_seen_s: float
    leaving: bool = False  # it is leaving (or left)
    codecs: str = ""  # its inbound link's "forward|backward" codecs
    admitted_by: str = ""  # the peer id whose signed admission it shows (the run's owner, if it is a member)

    @classmethod
    def of(cls, record, run_id: str) -> Announcement:
        return cls(
            record.addrs,
            record.throughput,
            record.queue,
            record.ready,
            max(0.0, get_dht_time() - record.updated),
            leaving=record.leaving,
            codecs="|".join(record.codecs.get(d, "") for d in ("forward", "backward")).strip("|"),
            admitted_by=_admitted_by(record, run_id),
        )


@dataclass
class Reach:
    """How the status call itself went: whether the peer answered, how fast, and if not, why."""

    reachable: bool = False
    rtt_ms: float | None = None
    error: str = ""


@dataclass
class Work:
    """What the peer does for the stage: its role, the micro-batches and steps it ran, its state's size
    and the bytes of each of its links."""

    role: str = ""  # serving, following (joining: downloading its state or catching up), leaving, idle
    processed: int = 0  # micro-batches
    steps: int = 0
    state_bytes: int = 0
    # {"neighbour", "boundary", "upstream", "sent", "received", "raw", "busy_s", "busy_bytes", "codecs"}
    links: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, status: pb.StageStatus) -> Work:
        links = [
            {
                "neighbour": link.neighbour,
                "boundary": link.boundary,
                "upstream": link.upstream,
                "sent": dict(link.sent),
                "received": dict(link.received),
                "raw": dict(link.raw),
                "busy_s": link.busy_s,
                "busy_bytes": link.busy_bytes,
                "codecs": f"{link.forward_codec}|{link.backward_codec}" if link.forward_codec else "",
            }
            for link in status.links
        ]
        return cls(status.role, status.processed, status.steps, status.state_bytes, links)


@dataclass
class Joining:
    """Stage state moved between peers mid-run: what it downloaded when it joined, what it served."""

    joined_step: int | None = None  # the step of the state it downloaded (None: it did not join mid-run)
    state_bytes_in: int = 0
    state_seconds: float = 0.0
    states_served: int = 0  # downloads of its state it served joiners
    state_bytes_out: int = 0

    @classmethod
    def of(cls, status: pb.StageStatus) -> Joining:
        joined = status.state_bytes_in > 0  # a peer that started with the run downloaded nothing (its joined_step is 0)
        return cls(
            status.joined_step if joined else None,
            status.state_bytes_in,
            status.state_seconds if joined else 0.0,
            status.states_served,
            status.state_bytes_out,
        )

    def describe(self) -> str:
        text = ""
        if self.joined_step is not None:
            text += f", joined at step {self.joined_step} ({_size(self.state_bytes_in)} in {self.state_seconds:.1f}s)"
        if self.states_served:
            text += f", gave its state {self.states_served}x ({_size(self.state_bytes_out)})"
        return text


@dataclass
class Recovery:
    """The swarm's copies of stage states the peer keeps, and its going back to one after a loss."""

    copies: list[tuple[int, int, int, float]] = field(default_factory=list)  # (stage, step, bytes, age in seconds)
    restores: int = 0
    restored_step: int = 0
    paused_s: float = 0.0

    @classmethod
    def of(cls, status: pb.StageStatus) -> Recovery:
        copies = [(c.stage, c.step, c.bytes, c.age_s) for c in status.snapshots]
        return cls(copies, status.restores, status.restored_step, status.paused_s)

    def describe(self) -> str:
        text = ""
        if self.restores:
            text += f", went back to step {self.restored_step} after a {self.paused_s:.1f}s pause ({self.restores}x)"
        if self.copies:  # the newest copy of each stage it keeps
            newest = {stage: (step, size, age) for stage, step, size, age in sorted(self.copies)}
            kept = ", ".join(
                f"stage {stage} step {step} ({_size(size)}, {age:.0f}s old)"
                for stage, (step, size, age) in newest.items()
            )
            text += f", copies: {kept}"
        return text


@dataclass
class Trust:
    """How the peer defends itself (docs/security.md): requests it refused, by why, and the peers it
    refuses now (a malformed payload or message, refusals that cost too much CPU). The peer's as a
    whole, not one stage's."""

    refused: dict[str, int] = field(default_factory=dict)
    banned: int = 0


@dataclass
class PeerRow:
    """One stage peer of one run, as `peers.status` shows it: its record, how asking it went, and
    what it answered for that stage (its events and trust figures are the whole peer's)."""

    run_id: str
    stage: int
    num_stages: int
    peer_id: str
    announced: Announcement
    reach: Reach = field(default_factory=Reach)
    work: Work = field(default_factory=Work)
    joining: Joining = field(default_factory=Joining)
    recovery: Recovery = field(default_factory=Recovery)
    trust: Trust = field(default_factory=Trust)
    events: list[Event] = field(default_factory=list)  # its recent events, oldest first
    network: str = "-"  # how it is reached: directly, or behind NAT through a relay (network_text)


def _admitted_by(record, run_id: str) -> str:
    """Who admitted the record's peer to `run_id`, by a valid signature; "" when nobody did."""
    try:
        admission = pb.Admission.FromString(record.admission)
        if admission.run_id != run_id or admission.peer_id != record.peer_id or not admission.signature:
            return ""
        return Admissions(run_id).signer(admission)
    except Exception:  # anything a stranger may have put there
        return ""


async def survey(node: SwarmNode, run_id: str | None = None, timeout: float | None = None) -> list[PeerRow]:
    """Every run's stage peers from the DHT, each asked for its status (at most `timeout` s each,
    default the settings' info_timeout_s)."""
    timeout = node.settings.calls.info_timeout_s if timeout is None else timeout
    runs = await list_runs(node)
    if run_id is not None:
        runs = {run_id: runs.get(run_id, 0)}
    rows: list[PeerRow] = []
    for run, num_stages in runs.items():
        stage = 0
        while stage < max(num_stages, 1):
            for record in await discover(node, run, stage):
                num_stages = max(num_stages, record.num_stages)
                rows.append(PeerRow(run, stage, record.num_stages, record.peer_id, Announcement.of(record, run)))
            stage += 1

    async def detail(row: PeerRow) -> None:
        started = time.perf_counter()
        try:
            frame = await ask(node.streams, row.peer_id, STUBS.info(to=address(row.run_id)), timeout)
            reply = frame.head
        except Exception as e:
            row.reach = Reach(error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        row.reach = Reach(reachable=True, rtt_ms=1000 * (time.perf_counter() - started))
        row.trust = Trust(dict(reply.refused), reply.banned)
        row.network = network_text(reply.reach) if reply.HasField("reach") else "-"
        row.events = [e for e in (Event.of(x.time, x.kind, x.text) for x in reply.events[-KEEP:]) if e is not None]
        for status in reply.stages:
            if status.stage == row.stage:
                row.work, row.joining, row.recovery = Work.of(status), Joining.of(status), Recovery.of(status)

    await asyncio.gather(*(detail(row) for row in rows))
    return rows


def state_text(row: PeerRow) -> str:
    """What a peer is doing: its role, how it joined, the downloads it served, its restores and copies."""
    if not row.reach.reachable:
        return "left" if row.announced.leaving else f"unreachable ({row.reach.error[:40]})"
    role = row.work.role or ("ready" if row.announced.ready else "waiting")
    return role + row.joining.describe() + row.recovery.describe()


def network_text(reach: pb.Reach) -> str:
    """How a peer is reached (swarm.transport.hivemind.net.reach): "direct", or "NAT via <relay>"
    with how its stage streams arrived, and what it relays for others."""
    arrived = ", ".join(f"{n} {how}" for how, n in sorted(reach.arrived.items()) if n)
    text = f"NAT via {reach.relay[-8:]}" if reach.state == "behind NAT" else "direct"
    text += f" (in: {arrived})" if arrived and reach.state == "behind NAT" else ""
    if reach.holding or reach.relayed_bytes:
        text += f", relays {reach.holding} ({_size(reach.relayed_bytes)})"
    return text


def _refused(trust: Trust) -> str:
    total = sum(trust.refused.values())
    if not total:
        return "-"
    return f"{total}" + (f" ({trust.banned} banned)" if trust.banned else "")


def format_table(rows: list[PeerRow]) -> str:
    if not rows:
        return "no stage peers found (is a run going, and are --initial_peers right?)"
    header = [
        "run",
        "stage",
        "peer",
        "address",
        "reached",
        "state",
        "rtt",
        "samples/s",
        "queue",
        "micro-batches",
        "steps",
        "link bytes out/in (compression)",
        "refused",
        "last seen",
    ]
    table = [header]
    for row in sorted(rows, key=lambda r: (r.run_id, r.stage, r.peer_id)):
        links = []
        for link in row.work.links:
            sent, received = sum(link["sent"].values()), sum(link["received"].values())
            side = "down" if link["upstream"] else "up"
            raw = sum(link.get("raw", {}).values())
            ratio = f" (x{raw / sent:.1f})" if sent and raw else ""
            # while arriving
            rate = f" in at {format_rate(link['busy_bytes'] * 8 / link['busy_s'])}" if link.get("busy_s") else ""
            codecs = f" [{link['codecs']}]" if link.get("codecs") else ""
            links.append(
                f"b{link['boundary']}{side}->{link['neighbour'][-6:]}: {_size(sent)}/{_size(received)}{ratio}{rate}{codecs}"
            )
        state = state_text(row)
        address = row.announced.addrs[0] if row.announced.addrs else "-"
        rtt = "-" if row.reach.rtt_ms is None else f"{row.reach.rtt_ms:.0f}ms"
        table.append(
            [
                row.run_id,
                f"{row.stage}/{row.num_stages}",
                row.peer_id[-8:],
                address,
                row.network,
                state,
                rtt,
                f"{row.announced.throughput:.1f}",
                str(row.announced.queue),
                str(row.work.processed),
                str(row.work.steps),
                "; ".join(links) or "-",
                _refused(row.trust),
                f"{row.announced.last_seen_s:.0f}s ago",
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table)
