"""The swarm as a table: every run's stages, their peers, addresses, throughput, bytes per link,
their compression ratio, the rate payloads arrive at and the codecs of each end, round-trip time,
and when each peer last announced itself (for `python -m peers.status`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from hivemind.utils import get_dht_time

from protocols import stage_pb2 as pb
from swarm.rates import format_rate
from swarm.transport.hivemind.announce import discover, list_runs
from swarm.transport.hivemind.calls import call
from swarm.transport.hivemind.events import KEEP, Event
from swarm.transport.hivemind.meta import address
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.trust.admissions import Admissions


@dataclass
class PeerRow:
    run_id: str
    stage: int
    num_stages: int
    peer_id: str
    addrs: list[str]
    throughput: float
    queue: int
    ready: bool
    last_seen_s: float
    reachable: bool = False
    processed: int = 0
    steps: int = 0
    state_bytes: int = 0
    # {"neighbour", "boundary", "upstream", "sent", "received", "raw", "busy_s", "busy_bytes", "codecs"}
    links: list[dict] = field(default_factory=list)
    rtt_ms: float | None = None  # of the status call itself
    error: str = ""
    role: str = ""  # serving, following (joining: downloading its state or catching up), leaving, idle
    leaving: bool = False  # its record says it is leaving (or left: the record outlives it a while)
    # joining mid-run: the step of the state it downloaded, its bytes and seconds; downloads it served
    joined_step: int | None = None
    state_bytes_in: int = 0
    state_seconds: float = 0.0
    states_served: int = 0
    state_bytes_out: int = 0
    # the swarm's copies it keeps: (stage, step, bytes, age in seconds); its restores from them
    copies: list[tuple[int, int, int, float]] = field(default_factory=list)
    restores: int = 0
    restored_step: int = 0
    paused_s: float = 0.0
    refused: dict[str, int] = field(default_factory=dict)  # requests it refused, by why (docs/security.md)
    banned: int = 0  # peers it refuses now for a malformed payload
    codecs: str = ""  # its inbound link's "forward|backward" codecs, as its record says
    admitted_by: str = ""  # the peer id whose signed admission its record shows (the run's owner, if it is a member)
    events: list[Event] = field(default_factory=list)  # its recent events, oldest first


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
    timeout = node.settings.info_timeout_s if timeout is None else timeout
    runs = await list_runs(node)
    if run_id is not None:
        runs = {run_id: runs.get(run_id, 0)}
    rows: list[PeerRow] = []
    for run, num_stages in runs.items():
        stage = 0
        while stage < max(num_stages, 1):
            for record in await discover(node, run, stage):
                num_stages = max(num_stages, record.num_stages)
                rows.append(
                    PeerRow(
                        run,
                        stage,
                        record.num_stages,
                        record.peer_id,
                        record.addrs,
                        record.throughput,
                        record.queue,
                        record.ready,
                        max(0.0, get_dht_time() - record.updated),
                        leaving=record.leaving,
                        codecs="|".join(record.codecs.get(d, "") for d in ("forward", "backward")).strip("|"),
                        admitted_by=_admitted_by(record, run),
                    )
                )
            stage += 1

    async def detail(row: PeerRow) -> None:
        started = time.perf_counter()
        try:
            frame = await call(node.streams, row.peer_id, "info", pb.InfoRequest(to=address(row.run_id)), b"", timeout)
            reply = frame.head
        except Exception as e:
            row.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            return
        row.rtt_ms = 1000 * (time.perf_counter() - started)
        row.reachable = True
        row.refused, row.banned = dict(reply.refused), reply.banned
        row.events = [e for e in (Event.of(x.time, x.kind, x.text) for x in reply.events[-KEEP:]) if e is not None]
        for status in reply.stages:
            if status.stage != row.stage:
                continue
            row.processed, row.steps, row.state_bytes = status.processed, status.steps, status.state_bytes
            row.role, row.states_served, row.state_bytes_out = status.role, status.states_served, status.state_bytes_out
            row.copies = [(c.stage, c.step, c.bytes, c.age_s) for c in status.snapshots]
            row.restores, row.restored_step, row.paused_s = status.restores, status.restored_step, status.paused_s
            if status.state_bytes_in:
                row.joined_step = status.joined_step
                row.state_bytes_in, row.state_seconds = status.state_bytes_in, status.state_seconds
            row.links = [
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

    await asyncio.gather(*(detail(row) for row in rows))
    return rows


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"


def state_text(row: PeerRow) -> str:
    """What a peer is doing: its role, how it joined, the downloads it served."""
    if not row.reachable:
        return "left" if row.leaving else f"unreachable ({row.error[:40]})"
    text = row.role or ("ready" if row.ready else "waiting")
    if row.joined_step is not None:
        text += f", joined at step {row.joined_step} ({_size(row.state_bytes_in)} in {row.state_seconds:.1f}s)"
    if row.states_served:
        text += f", gave its state {row.states_served}x ({_size(row.state_bytes_out)})"
    if row.restores:
        text += f", went back to step {row.restored_step} after a {row.paused_s:.1f}s pause ({row.restores}x)"
    if row.copies:  # the newest copy of each stage it keeps
        newest = {stage: (step, size, age) for stage, step, size, age in sorted(row.copies)}
        kept = ", ".join(
            f"stage {stage} step {step} ({_size(size)}, {age:.0f}s old)" for stage, (step, size, age) in newest.items()
        )
        text += f", copies: {kept}"
    return text


def _refused(row: PeerRow) -> str:
    total = sum(row.refused.values())
    if not total:
        return "-"
    return f"{total}" + (f" ({row.banned} banned)" if row.banned else "")


def format_table(rows: list[PeerRow]) -> str:
    if not rows:
        return "no stage peers found (is a run going, and are --initial_peers right?)"
    header = [
        "run",
        "stage",
        "peer",
        "address",
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
        for link in row.links:
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
        address = row.addrs[0] if row.addrs else "-"
        rtt = "-" if row.rtt_ms is None else f"{row.rtt_ms:.0f}ms"
        table.append(
            [
                row.run_id,
                f"{row.stage}/{row.num_stages}",
                row.peer_id[-8:],
                address,
                state,
                rtt,
                f"{row.throughput:.1f}",
                str(row.queue),
                str(row.processed),
                str(row.steps),
                "; ".join(links) or "-",
                _refused(row),
                f"{row.last_seen_s:.0f}s ago",
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table)
