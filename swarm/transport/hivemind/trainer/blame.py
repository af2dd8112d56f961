"""Whom a failed averaging group failed on: the trainer's reading of its members' gather replies
when only groups failed (swarm.transport.hivemind.trainer.rounds)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError


def blamed_members(
    peers: Sequence[tuple[int, str]],
    replies: Sequence,
    members: dict[int, list[str]],
    serving: Callable[[int], list[str]],
) -> list[tuple[int, str, str]]:
    """The members to leave out, in order, as (stage, peer, why): those the failed groups failed on,
    while their stage keeps another peer in service, so a member that answers its gather with
    success but never sums with its group cannot hold the step. An info reply proves nothing here.

    Those whose own reply contradicts the failure (success) leave first, then those more members
    named, then those whose own failure names nobody else (where a cascade starts), then the latest
    admitted. A member named only by members already left stays, and so does one whose own
    failure names one who left: failures cascade (a member that stops fails its groups itself, a
    member that aborts answers the others with errors, and one that already gave up on a group
    answers a later part of it with BAD_GROUP_ID, so its partners name it)."""
    stage_of = {peer: stage for stage, peer in peers}
    accusers: dict[str, set[str]] = defaultdict(set)
    accused: dict[str, set[str]] = defaultdict(set)  # whom each member's own failure names
    answered = set()
    for (_, peer), reply in zip(peers, replies, strict=True):
        if not isinstance(reply, BaseException):
            answered.add(peer)
        elif isinstance(reply, RemoteError) and reply.code == pb.GROUP_FAILED:
            for named in reply.blamed:
                if named in stage_of and named != peer:
                    accusers[named].add(peer)
                    accused[peer].add(named)

    def order(peer: str) -> tuple:
        return peer not in answered, -len(accusers[peer]), bool(accused[peer]), -members[stage_of[peer]].index(peer)

    left: dict[str, tuple[int, str, str]] = {}
    for peer in sorted(accusers, key=order):
        stage, named_by = stage_of[peer], accusers[peer] - left.keys()
        if not named_by or not [other for other in serving(stage) if other != peer and other not in left]:
            continue
        if accused[peer] & left.keys():  # its own failure came from one who left: it failed in turn
            continue
        why = ", ".join(sorted(p[-8:] for p in named_by))
        contradiction = "; it answered the gather round with success" if peer in answered else ""
        left[peer] = (stage, peer, f"its averaging group failed on it (named by {why}){contradiction}")
    return list(left.values())
