"""The trainer's word on its run, on the DHT: step, loss, pace, state (training, paused, finished),
peers in service per stage and its recent events (joins, leaves, bans, pauses), for the health
page (`python -m peers.status --serve`).

One key per run; the subkey holds the owner's key (`[owner:KEY]`), so only the run's owner can
write its record (hivemind's RSASignatureValidator, which every hivepipe node runs) and a reader
takes the record of the owner the run's config names. Values are read as untrusted: anything
malformed is dropped, everything bounded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.utils import get_dht_time

from swarm.transport.hivemind.dht.periodic import Refresher
from swarm.transport.hivemind.net.events import KEEP, Event
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.schemas import owned

log = logging.getLogger(__name__)
EVERY_S = 2.0  # the record is refreshed at least this often (the page shows it within seconds)
STATE_CHARS = 200


def status_key(run_id: str) -> str:
    return f"hivepipe.{run_id}.trainer"


def _number(value, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value) if integer else float(value)


@dataclass
class RunStatus:
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    samples_per_s: float = 0.0
    eta_s: float | None = None
    state: str = "starting"
    members: dict[int, int] = field(default_factory=dict)  # stage -> peers in service
    events: list[Event] = field(default_factory=list)  # oldest first
    trainer: str = ""  # the trainer's peer id (the owner's key signs the record)
    updated: float = 0.0  # DHT time
    owner: str = ""  # the signer's peer id (from the subkey)

    def to_value(self) -> dict:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "loss": self.loss,
            "samples_per_s": self.samples_per_s,
            "eta_s": self.eta_s,
            "state": self.state,
            "members": {str(stage): n for stage, n in self.members.items()},
            "events": [[e.time, e.kind, e.text] for e in self.events[-KEEP:]],
            "trainer": self.trainer,
            "updated": self.updated,
        }

    @classmethod
    def from_value(cls, value, owner: str) -> RunStatus | None:
        if not isinstance(value, dict):
            return None
        step, updated = _number(value.get("step"), True), _number(value.get("updated"))
        if step is None or step < 0 or updated is None:
            return None
        members = value.get("members")
        events = value.get("events")
        members = members if isinstance(members, dict) and len(members) <= 4096 else {}
        events = events if isinstance(events, list | tuple) else []
        status = cls(
            step=step,
            total_steps=_number(value.get("total_steps"), True),
            loss=_number(value.get("loss")),
            samples_per_s=max(0.0, _number(value.get("samples_per_s")) or 0.0),
            eta_s=_number(value.get("eta_s")),
            state=" ".join(str(value.get("state", "")).split())[:STATE_CHARS],
            trainer=str(value.get("trainer", ""))[:100],
            updated=updated,
            owner=owner,
        )
        for stage, n in members.items():
            if str(stage).isascii() and str(stage).isdigit() and (count := _number(n, True)) is not None:
                status.members[int(stage)] = count
        for item in list(events)[-KEEP:]:
            if isinstance(item, list | tuple) and len(item) == 3 and (event := Event.of(*item)) is not None:
                status.events.append(event)
        return status


async def publish_status(node: SwarmNode, run_id: str, status: RunStatus, ttl: float) -> bool:
    """Stores `status` as the run owner's (this node signs with the owner's key)."""
    status.updated = get_dht_time()
    return await node.dht.store(status_key(run_id), status.to_value(), get_dht_time() + ttl, subkey=node.owned_by)


async def fetch_status(node: SwarmNode, run_id: str, owner: str) -> RunStatus | None:
    """The run's status record signed by `owner` (anyone may sign one for any run: name the owner)."""
    found = await node.dht.get(status_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    best = None
    for subkey, item in found.value.items():
        signer = owned(subkey)
        if signer is None or signer[0] or signer[1] != owner:
            continue
        status = RunStatus.from_value(getattr(item, "value", None), signer[1])
        if status is not None and (best is None or status.updated > best.updated):
            best = status
    return best


class StatusPublisher(Refresher):
    """Publishes `make()` (a fresh RunStatus) every EVERY_S seconds until stopped."""

    def __init__(self, node: SwarmNode, run_id: str, make: Callable[[], RunStatus]) -> None:
        super().__init__(node)
        self.period = min(self.period, EVERY_S)
        self.run_id, self.make = run_id, make

    async def refresh(self) -> None:
        try:
            await publish_status(self.node, self.run_id, self.make(), self.ttl)
        except Exception as e:  # the DHT may be briefly unreachable; the next round retries
            log.debug("publishing the status of run %s failed: %s", self.run_id, e)


async def start_status(node: SwarmNode, run_id: str, make: Callable[[], RunStatus]) -> StatusPublisher:
    """Publishes the run's status from now on (the node signs with the owner's key)."""
    publisher = StatusPublisher(node, run_id, make)
    publisher.start()
    return publisher
