"""Stage announcements on the DHT: one key per (run, stage), one subkey per peer: the peer's public
key, so that only the peer itself can write its record (hivemind's RSASignatureValidator, which
every hivepipe node runs), and a reader knows whose record it is.

hivemind's `declare_experts` stores one plain value per uid, so two peers serving a stage would
overwrite each other; subkeys (as Petals does) keep them all. Records expire unless refreshed, so
a dead peer drops out on its own.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

from hivemind.utils import get_dht_time

from protocols.version import PROTOCOL_VERSION
from swarm.transport.hivemind.dht.periodic import Refresher
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.schemas import RUNS_KEY, owned

log = logging.getLogger(__name__)


MAX_STAGES = 1024  # a record or listing claiming more stages is a stranger's garbage


def _finite(value, least: float = 0.0) -> float:
    number = float(value)
    if not math.isfinite(number) or number < least:
        raise ValueError(f"{value!r} is not a finite number >= {least}")
    return number


def stage_key(run_id: str, stage: int) -> str:
    return f"hivepipe.{run_id}.stage{stage}"


@dataclass
class StageRecord:
    """What a stage peer says about itself (plain data: DHT values are msgpack)."""

    peer_id: str
    stage: int
    num_stages: int
    addrs: list[str]
    throughput: float = 0.0  # samples per second, EMA; 0 until measured
    queue: int = 0
    codecs: dict[str, str] = field(default_factory=dict)  # {"forward": spec, "backward": spec} of the inbound link
    version: int = PROTOCOL_VERSION
    ready: bool = False  # set up by the run's trainer: it can take micro-batches
    updated: float = 0.0
    session: str = ""  # the trainer session it was set up by (peers route only within one session)
    # payload bits/s it takes per incoming flow (swarm.transport.hivemind.flow.pacing); 0: not declared
    download_share: float = 0.0
    leaving: bool = False  # draining: it takes no new micro-batch and leaves at the next step boundary
    admission: bytes = b""  # the owner's pb.Admission of it to `session` (swarm.transport.hivemind.trust)
    token: bytes = b""  # the owner's pb.Token letting it into a private run (peers.stage --token)
    relay: str = ""  # behind NAT: the peer that relays streams to it (swarm.transport.hivemind.net.reach)

    @classmethod
    def from_value(cls, peer_id: str, value) -> StageRecord | None:
        if not isinstance(value, dict):
            return None
        try:
            num_stages, stage = int(value["num_stages"]), int(value["stage"])
            if not 0 <= stage < num_stages <= MAX_STAGES:
                return None
            return cls(
                peer_id=peer_id,
                stage=stage,
                num_stages=num_stages,
                addrs=[str(a) for a in value.get("addrs", [])][:16],
                throughput=_finite(value.get("throughput", 0.0)),
                queue=max(0, int(value.get("queue", 0))),
                codecs={str(k): str(v) for k, v in dict(value.get("codecs", {})).items()},
                version=int(value.get("version", 0)),
                ready=bool(value.get("ready", False)),
                updated=_finite(value.get("updated", 0.0)),
                session=str(value.get("session", "")),
                download_share=max(0.0, _finite(value.get("download_share", 0.0), -math.inf)),
                leaving=bool(value.get("leaving", False)),
                admission=bytes(value.get("admission", b"")),
                token=bytes(value.get("token", b"")),
                relay=str(value.get("relay", ""))[:128],
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return None

    def to_value(self) -> dict:
        value = asdict(self)
        value.pop("peer_id")
        return value


async def list_run(node: SwarmNode, run_id: str, num_stages: int, expires: float) -> bool:
    """Lists `run_id` among the runs; the entry's subkey names this peer's key (only it rewrites it)."""
    return await node.dht.store(RUNS_KEY, {"num_stages": num_stages}, expires, subkey=run_id.encode() + node.owned_by)


async def announce(node: SwarmNode, run_id: str, record: StageRecord, ttl: float) -> bool:
    record.updated = get_dht_time()
    expires = get_dht_time() + ttl
    await list_run(node, run_id, record.num_stages, expires)
    # the subkey is the peer's key: only it can write its record (RSASignatureValidator), and the
    # record's peer id is the one that key stands for
    return await node.dht.store(stage_key(run_id, record.stage), record.to_value(), expires, subkey=node.owned_by)


async def list_runs(node: SwarmNode) -> dict[str, int]:
    """run id -> number of stages, for every run with a live stage peer."""
    found = await node.dht.get(RUNS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    runs = {}
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        lister = owned(subkey)
        if lister and isinstance(value, dict) and isinstance(value.get("num_stages"), int):
            if 1 <= value["num_stages"] <= MAX_STAGES:
                runs[lister[0].decode(errors="replace")] = int(value["num_stages"])
    return dict(sorted(runs.items()))


async def discover(node: SwarmNode, run_id: str, stage: int) -> list[StageRecord]:
    """Every live peer announcing `stage` of `run_id` in a record signed with its own key (any
    protocol version: callers filter)."""
    found = await node.dht.get(stage_key(run_id, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, item in found.value.items():
        announcer = owned(subkey)  # only the key itself: the record's peer id is the one it stands for
        peer_id = announcer[1] if announcer and not announcer[0] else None
        record = StageRecord.from_value(peer_id, getattr(item, "value", None)) if peer_id else None
        if record is not None and record.stage == stage:
            records.append(record)
            node.reach.learn(record.peer_id, record.relay)
    return sorted(records, key=lambda r: r.peer_id)


class Announcer(Refresher):
    """Re-announces records every `announce_every_s` seconds (the node's settings) until stopped."""

    def __init__(self, node: SwarmNode, records) -> None:
        super().__init__(node)
        self.records = records  # callable -> list[(run_id, StageRecord)]

    async def announce_now(self) -> None:
        for run_id, record in self.records():
            try:
                await announce(self.node, run_id, record, self.ttl)
            except Exception as e:  # the DHT may be briefly unreachable; the next round retries
                log.warning("announcing stage %s of %s failed: %s", record.stage, run_id, e)

    refresh = announce_now
