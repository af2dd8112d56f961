"""An asynchronous step (train.schedule async: swarm.engine.delay) over a stage with two or more
peers, or of a model with parameters tied across stages, closed by one round (trainer.closing
`late_round`): each replica holds only the gradients of the micro-batches routed through it, and a
tied parameter's gradient is the sum of two stages', so no peer can take its stage's norm on the way.

The round is the gather round's `held` form with averaging groups: every peer sums the held
gradients of the micro-batches it ran (in index order), a replicated stage's peers sum those among
themselves (swarm.transport.hivemind.stage.combine) and keep the whole as the step's gradients
until its decision applies them; then a tied parameter's group adds its two stages' wholes, one
peer of each contributing; every peer answers the squared norm of what it keeps. No p.grad
is touched: the round runs while the next step's micro-batches are in flight, and the step before
may not be applied yet.

A replica lost during the round took gradients of micro-batches that cannot run again (the next
step's moved the weights on): the round fails with `OUTRUN`'s words, and the run goes back to the
swarm's copies (trainer.recovery), or ends without them; nothing is applied meanwhile. One that
held none of the step's is left out and the round goes again with new groups.
"""

from __future__ import annotations

import asyncio

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError, one_line
from protocols.wire_names import OUTRUN
from swarm.transport.hivemind.trainer.membership import Membership
from swarm.transport.hivemind.trainer.rounds import SwarmRounds


def replicated(membership: Membership) -> bool:
    """Whether a stage has two or more members (its step closes by `summed`)."""
    return any(len(peers) > 1 for peers in membership.members.values())


async def summed(rounds: SwarmRounds, step: int, whole: int = 0) -> tuple[float, float]:
    """Every stage's squared norm of its gradients of `step` (replicas' summed among themselves,
    tied parameters' across their two stages), added in stage order as the set_grads round adds
    them, and the rate the step ran at (stage 0's, from a peer that ran micro-batches of it).
    `whole`: every peer holds all of the step's `whole` micro-batches (a restored step's kept
    gradients, or dc's step before with one peer per stage), so only tied parameters are summed."""
    place = rounds.place
    for _ in range(place.settings.retries.attempts):
        peers = rounds.membership.peers()
        counted = {key: list(range(whole)) for key in peers} if whole else rounds.counted()
        groups = rounds.groups(peers, held=True, replicas=not whole)  # new ones every attempt
        replies = await asyncio.gather(
            *(
                rounds.gather_on(
                    s, p, counted.get((s, p), []), groups.get((s, p), []), held=True, earlier=step if whole else None
                )
                for s, p in peers
            ),
            return_exceptions=True,
        )
        failed = [(s, p, r) for (s, p), r in zip(peers, replies, strict=True) if isinstance(r, BaseException)]
        if not failed:
            return _norms(place.num_stages, counted, dict(zip(peers, (r.head for r in replies), strict=True)))
        _leave_out(rounds, peers, replies, failed)
        gone = set(peers) - set(rounds.membership.peers())
        if not gone or (not whole and any(counted.get(key) for key in gone)):  # what it held of the step is lost
            raise TransportError(
                f"step {step}: the replicas' round failed ({one_line(failed[0][2])}): the next step's "
                f"micro-batches moved the weights on, {OUTRUN}"
            )
        await asyncio.sleep(place.settings.retries.backoff_s)  # it held nothing of the step: again without it
    raise TransportError(f"step {step}: the replicas' round kept failing ({one_line(failed[0][2])})")


def _leave_out(rounds: SwarmRounds, peers: list[tuple[int, str]], replies: list, failed: list) -> None:
    """The members that failed the round leave it while their stage keeps a peer: those that did not
    answer, else those the failed groups blame (trainer.blame)."""
    membership = rounds.membership
    for _, _, error in failed:
        if not isinstance(error, TransportError | RemoteError):
            raise error
    lost = [(s, p, e) for s, p, e in failed if not (isinstance(e, RemoteError) and e.code == pb.GROUP_FAILED)]
    for stage, peer, error in lost:
        if [other for other in membership.serving(stage) if other != peer]:
            rounds.place.router.failed(peer)
            membership.drop(stage, peer, one_line(error))
    if not lost:
        rounds.leave_out_blamed(peers, replies)


def _norms(num_stages: int, counted: dict, answers: dict) -> tuple[float, float]:
    squares = 0.0
    for stage in range(num_stages):  # a stage's peers keep the same sum: the first one's norm
        squares += next(head.held_sq_norm for (s, _), head in answers.items() if s == stage)
    first = [(head, bool(counted.get((s, p)))) for (s, p), head in answers.items() if s == 0]
    return squares, max(first, key=lambda answer: answer[1])[0].lr  # one that ran micro-batches of it
