"""The swarm as the health page shows it (`python -m peers.status --serve`, `--json`): every run
with its trainer's status record, each stage as a column of its peers, each link between two
peers with the rate each direction arrives at and its compression ratio, and the recent events of
the trainer and the peers, newest first.

`read_swarm` asks the DHT and the peers (as `peers.status` does); `health_data` shapes what they
said into plain JSON data (the page's format: swarm/transport/hivemind/monitor/page.html).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from hivemind.utils import get_dht_time

from swarm.transport.hivemind.dht.announce import list_runs
from swarm.transport.hivemind.dht.runconfig import fetch_configs
from swarm.transport.hivemind.dht.runstatus import RunStatus, fetch_status
from swarm.transport.hivemind.dht.survey import PeerRow, state_text, survey
from swarm.transport.hivemind.net.events import Event
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.stage.status import by_direction

EVENTS_SHOWN = 100  # per run, newest first
REFRESH_S = 2.0  # the page asks for new data this often


def to_json(data, indent: int | None = None) -> str:
    """`data` as strict JSON: a number a peer reported as NaN or infinite becomes null (a browser's
    JSON parser refuses NaN, and one such number would freeze the page)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [clean(item) for item in value]
        return value

    return json.dumps(clean(data), indent=indent, allow_nan=False)


def short(peer_id: str) -> str:
    return "..." + peer_id[-8:]


async def read_swarm(node: SwarmNode, run_id: str | None = None, timeout: float | None = None) -> dict:
    """What the page shows, read now from the DHT and the peers."""
    rows = await survey(node, run_id, timeout)
    runs = await list_runs(node)
    if run_id is not None:
        runs = {run_id: runs.get(run_id, 0)}
    for row in rows:
        runs[row.run_id] = max(runs.get(row.run_id, 0), row.num_stages)

    async def trainer(run: str) -> tuple[str, RunStatus | None]:
        """The run's owner and its status record: the one who signed the run's config and admitted
        its stage peers (either, when the other says nothing); none when that is not one key, so a
        stranger's record never passes for the trainer's."""
        signed = {c.owner for c in await fetch_configs(node, run) if c.owner}
        admitting = {row.announced.admitted_by for row in rows if row.run_id == run and row.announced.admitted_by}
        owners = (signed & admitting) or (signed if len(signed) == 1 else set() if signed else admitting)
        if len(owners) != 1:
            return "", None
        owner = owners.pop()
        return owner, await fetch_status(node, run, owner)

    found = await asyncio.gather(*(trainer(run) for run in runs))
    return health_data(rows, runs, dict(zip(runs, found, strict=True)), time.time(), get_dht_time())


def _peer(row: PeerRow) -> dict:
    announced, reach = row.announced, row.reach
    return {
        "peer_id": row.peer_id,
        "short": short(row.peer_id),
        "address": announced.addrs[0] if announced.addrs else "",
        "reached": row.network,  # directly, or behind NAT through a relay (survey.network_text)
        "role": row.work.role or ("left" if announced.leaving else ""),
        "state": state_text(row),
        "reachable": reach.reachable,
        "error": reach.error,
        "throughput": announced.throughput,
        "queue": announced.queue,
        "micro_batches": row.work.processed,
        "steps": row.work.steps,
        "last_seen_s": announced.last_seen_s,
        "rtt_ms": reach.rtt_ms,
        "codecs": announced.codecs,
        "refused": sum(row.trust.refused.values()),
    }


def _links(rows: list[PeerRow]) -> list[dict]:
    """One entry per (boundary, sender of activations, receiver). Each end tells what it sent (bytes
    and their compression) and the rate at which what it receives arrives."""
    links: dict[tuple[int, str, str], dict] = {}
    for row in rows:
        for link in row.work.links:
            if link["upstream"]:  # this peer sends activations to its neighbour and hears gradients back
                key, sends, hears = (link["boundary"], row.peer_id, link["neighbour"]), "forward", "backward"
            else:
                key, sends, hears = (link["boundary"], link["neighbour"], row.peer_id), "backward", "forward"
            entry = links.setdefault(key, {d: {"mbit_s": None, "ratio": None, "bytes": 0} for d in (sends, hears)})
            sent, raw = by_direction(link["sent"])[sends], by_direction(link["raw"])[sends]
            entry[sends].update(bytes=sent, ratio=raw / sent if sent and raw else None)
            if link["busy_s"] > 0:
                entry[hears]["mbit_s"] = link["busy_bytes"] * 8 / link["busy_s"] / 1e6
    return [
        {"boundary": boundary, "from": sender, "to": receiver, **entry}
        for (boundary, sender, receiver), entry in sorted(links.items())
    ]


def _event(event: Event, source: str, now: float) -> dict:
    return {
        "time": event.time,
        "age_s": max(0.0, now - event.time),
        "kind": event.kind,
        "source": source,
        "text": event.text,
    }


def health_data(
    rows: list[PeerRow],
    runs: dict[str, int],
    trainers: dict[str, tuple[str, RunStatus | None]],
    now: float,
    dht_now: float,
) -> dict:
    """The page's data: `runs` (run id -> stages), the peers' `rows` (a survey), per run its owner
    and trainer status record; `now` is this machine's clock, `dht_now` the DHT's."""
    out = []
    for run_id, num_stages in sorted(runs.items()):
        mine = sorted((r for r in rows if r.run_id == run_id), key=lambda r: (r.stage, r.peer_id))
        num_stages = max([num_stages, *(r.num_stages for r in mine)])
        owner, status = trainers.get(run_id, ("", None))
        progress = None
        events = []
        if status is not None:
            progress = {
                "step": status.step,
                "total_steps": status.total_steps,
                "loss": status.loss,
                "samples_per_s": status.samples_per_s,
                "eta_s": status.eta_s,
                "state": status.state,
                "age_s": max(0.0, dht_now - status.updated),
                "trainer": status.trainer,
                "members": {str(stage): n for stage, n in sorted(status.members.items())},
            }
            events = [_event(e, "trainer", now) for e in status.events]
        told = set()  # a peer hosting two stages of the run reports its events once
        for row in mine:
            if row.peer_id not in told:
                told.add(row.peer_id)
                events += [_event(e, f"stage {row.stage} peer {short(row.peer_id)}", now) for e in row.events]
        events.sort(key=lambda e: -e["time"])
        stages = [
            {"stage": stage, "peers": [_peer(r) for r in mine if r.stage == stage]} for stage in range(num_stages)
        ]
        out.append(
            {
                "run_id": run_id,
                "num_stages": num_stages,
                "owner": owner,
                "progress": progress,
                "stages": stages,
                "links": _links(mine),
                "events": events[:EVENTS_SHOWN],
            }
        )
    return {"generated": now, "refresh_s": REFRESH_S, "error": "", "runs": out}
