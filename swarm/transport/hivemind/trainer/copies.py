"""What the trainer knows of the swarm's copies (swarm.transport.hivemind.stage.snapshots): one copy a
peer keeps, the newest step of which copies of every stage exist, and what the copies cost and
mended (the run's summary)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Held:
    """One copy a peer keeps: of `stage` at `step`, on `peer`, which hosts `hosted` (where to ask it)."""

    peer: str
    hosted: int
    stage: int
    step: int
    lineage: str
    sha256: bytes = b""


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
