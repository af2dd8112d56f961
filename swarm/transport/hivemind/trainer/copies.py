"""What the trainer knows of the swarm's copies (swarm.transport.hivemind.stage.snapshots): one copy a
peer keeps, the newest step of which copies of every stage exist, and what the copies cost and
mended (the run's summary)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.flow.pacing import MIN_OFFER_BITS
from swarm.transport.hivemind.trust import manifests


@dataclass(frozen=True)
class Held:
    """One copy a peer keeps: of `stage` at `step`, on `peer`, which hosts `hosted` (where to ask it)."""

    peer: str
    hosted: int
    stage: int
    step: int
    lineage: str
    sha256: bytes = b""


Accepted = dict[tuple[str, int], dict[int, manifests.Named]]  # (lineage, step) -> stage -> what the owner names


def shown_manifests(statuses: dict, owner: str, run_id: str) -> Accepted:
    """What the manifests the peers' `statuses` show name, of those `owner` signed for `run_id`."""
    answered = [status for status in statuses.values() if isinstance(status, pb.StageStatus)]
    return manifests.accepted([m for status in answered for m in status.manifests], owner, run_id)


def named_of(accepted: Accepted, lineage: str, step: int, stage: int) -> manifests.Named:
    return accepted.get((lineage, step), {}).get(stage) or manifests.Named()


def held_named(statuses: dict, accepted: Accepted) -> list[Held]:
    """The copies the peers' `statuses` ({(hosted stage, peer): status}) say they keep, of those
    `accepted` names: a copy no manifest of the owner's names is never restored nor exported."""
    return [
        Held(peer, stage, int(c.stage), int(c.step), c.lineage, bytes(c.sha256))
        for (stage, peer), status in statuses.items()
        if isinstance(status, pb.StageStatus)
        for c in status.snapshots
        if bytes(c.sha256) in named_of(accepted, c.lineage, int(c.step), int(c.stage)).copies
    ]


def newest_complete(copies: list[Held], num_stages: int, lineage: str | None = None):
    """The newest step of which `copies` hold every stage (of `lineage`, or of whichever lineage
    has the newest such step): (lineage, step, {stage: [(peer, hosted)]}), or None."""
    by_lineage: dict[str, dict[int, dict[int, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for c in copies:
        if c.lineage and (lineage is None or c.lineage == lineage):
            by_lineage[c.lineage][c.step][c.stage].append((c.peer, c.hosted))
    best = None
    for name, steps in by_lineage.items():
        for step, stages in steps.items():
            if len(stages) == num_stages and (best is None or step > best[1]):
                best = (name, step, {s: list(dict.fromkeys(sources)) for s, sources in stages.items()})
    return best


@dataclass
class History:
    """What the swarm's copies cost and what they mended: snapshot rounds, their seconds and the last
    copy's size per stage; the pauses (restores) and the restarts (a new trainer took over), which a
    new trainer carries on."""

    rounds: int = 0
    rounds_s: float = 0.0
    copy_bytes: dict[int, int] = field(default_factory=dict)
    pauses: list[dict] = field(default_factory=list)  # {"from_step", "to_step", "paused_s"} per restore
    restarts: list[dict] = field(default_factory=list)  # {"to_step"}: a new trainer took the run over there


FETCH_MARGIN = 1.5  # a paced copy shares its link with the payloads: it may arrive later than its rate says


def fetch_seconds(taken: dict, holders: dict[int, int], sources: dict[int, str]) -> float:
    """How long the holders' fetches of a round's copies take: per stage, its copy's bytes times its
    `holders` (all fetch from its first peer, `sources`) at the rate that peer sends copies at
    (`taken`: (stage, peer) -> its SnapshotReply frame; 0 when every copy goes unpaced). A rate
    below MIN_OFFER_BITS counts as that much, one that is not a rate as none: no peer can hold the
    next rounds off for ever by the rate it reports."""
    longest = 0.0
    for stage, count in holders.items():
        frame = taken.get((stage, sources.get(stage)))
        bits = frame.head.background_bits if frame is not None else 0.0
        if math.isfinite(bits) and bits > 0:
            longest = max(longest, int(frame.head.bytes) * count * 8 / max(bits, MIN_OFFER_BITS))
    return longest * FETCH_MARGIN
