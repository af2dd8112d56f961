"""What the trainer reads of its stage peers' statuses: the bytes every link carried (those of
peers that left included, as they last reported), every peer's compute, the state it keeps."""

from __future__ import annotations

from collections import Counter

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.trainer.membership import Membership, TrainerPlace


class Accounts:
    """The trainer's reads of its members' statuses."""

    def __init__(self, place: TrainerPlace, membership: Membership) -> None:
        self.place, self.membership = place, membership
        self.step_statuses: list[pb.StageStatus] | None = None  # this step's adaptive decision read them
        self.counted: list[pb.StageStatus] | None = None  # what link_bytes last read (its stages' compute)
        # the last status of every stage peer heard from, by (peer, stage, the step it joined at):
        # the bytes of peers that left still count in the totals
        self.reported: dict[tuple[str, int, int], pb.StageStatus] = {}

    async def statuses(self) -> list[pb.StageStatus]:
        found = await self.place.statuses(self.membership.peers(), self.place.settings.calls.call_timeout_s)
        statuses = []
        for (_, peer), status in found.items():
            if isinstance(status, BaseException):  # it left: its last status stays in `reported`
                continue
            self.reported[(peer, status.stage, status.joined_step)] = status
            statuses.append(status)
        return statuses

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent per boundary, direction and mode, summed over peers (as LocalPipeline counts),
        those that left included (as they last reported)."""
        totals: Counter = Counter()
        statuses, self.step_statuses = self.step_statuses, None
        self.counted = statuses if statuses is not None else self.place.loop.run(self.statuses())
        for status in self.reported.values():
            for link in status.links:
                for key, n in link.sent.items():
                    direction, mode = key.split(".", 1)
                    totals[f"boundary{link.boundary}.{direction}.{mode}"] += n
        return dict(sorted(totals.items()))

    def compute_notes(self) -> list[dict] | None:
        """Every stage peer's compute so far, as link_bytes last read it."""
        if self.counted is None:
            return None
        keys = ("stage", "compute_s", "compute_cpu_s", "samples")
        return [{key: getattr(status, key) for key in keys} for status in self.counted]
