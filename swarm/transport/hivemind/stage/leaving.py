"""Leaving a run without the run noticing (a stage peer's SIGTERM or Ctrl-C).

The peer first waits until another peer of its stage is in service: without one the run would
have to stop. Then its record says it is leaving (routers stop choosing it) and it refuses new
micro-batches with UNAVAILABLE (their senders retry on another peer of the stage), finishes the
micro-batches it holds, and stays until a step's apply round has taken the gradients it holds:
its apply reply tells the trainer to leave it out from the next step on. With an asynchronous
schedule a step's gradients are applied two steps on, so it says so at the first apply after
which every gradient it holds is in its replicas' sums too (`StageState.nothing_unshared`). It
then still refuses micro-batches until the routers that saw its old record have looked again, so
none is sent to a peer that is gone. A peer holding nothing (between runs, not set up, still joining) or whose run
has been quiet for a call timeout leaves at once.

The last peer of a stage does not wait when there is no run left to stop: its owner's status record
(`dht.runstatus`) says the run ended (finished, interrupted, failed), or there is no such record and
no micro-batch or step round came for a record's lifetime. A live trainer refreshes its record every few seconds
(it outlives a pause), so its absence over that span, seen twice, means the trainer is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from swarm.transport.hivemind.dht.runstatus import fetch_status
from swarm.transport.hivemind.routing.router import Router
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.rounds import StageRounds
from swarm.transport.hivemind.stage.state import StageMeters, StagePlace, StageState

REPLY_GRACE_S = 1.0  # after its last apply reply, for the reply to reach the trainer
POLL_S = 0.05
ENDED = ("finished", "interrupted", "failed")  # the trainer's last states (peers/trainer.py); "failed: why"
RECHECK_S = 1.0  # a missing record is looked up once more: one lost DHT reply must not end a live run


async def _owner_says(place: StagePlace, owner: str | None) -> str | None:
    """The run's state in its owner's status record, None when there is none (or no owner yet)."""
    if owner is None:
        return None
    try:
        status = await fetch_status(place.node, place.run_id, owner)
    except Exception:  # the DHT may be briefly unreachable: no word, the caller looks again
        return None
    return None if status is None else status.state


async def run_over(place: StagePlace, rounds: StageRounds, meters: StageMeters, owner: str | None) -> str | None:
    """Why no run is left to stop (the owner ended it, or its trainer is gone), else None."""
    state = await _owner_says(place, owner)
    if state is not None:
        return f"run {place.run_id!r} is {state}" if state.startswith(ENDED) else None
    lifetime = place.settings.dht.record_ttl_s

    def quiet() -> bool:  # no micro-batch and no step round lately (a saturated link can lose a lookup)
        return time.monotonic() - max(rounds.last_s, meters.last_s) >= lifetime

    if not quiet():
        return None
    await asyncio.sleep(RECHECK_S)
    if await _owner_says(place, owner) is not None or not quiet():
        return None
    return f"run {place.run_id!r} has no trainer (no status record, no micro-batch or step round for {lifetime:.0f}s)"


async def others_serving(place: StagePlace, state: StageState, router: Router) -> list[str]:
    """The stage's other peers in service for the same trainer session (the DHT's view)."""
    records = await router.peers(place.stage, refresh=True)
    return [
        r.peer_id
        for r in records
        if r.ready and not r.leaving and r.session == state.session_id and r.peer_id != place.peer_id
    ]


async def drain(parts: StageParts, router: Router, rounds: StageRounds, say: Callable[[str], None]) -> None:
    """Returns once the stage can leave without its run noticing (the run's owner's status record
    says when the run is over)."""
    place, state, meters, peer, owner = parts.place, parts.state, parts.meters, parts.peer, parts.gate.owner
    if state.runtime is None or state.joining is not None:
        return
    told = False
    while True:
        if over := await run_over(place, rounds, meters, owner):  # (a replica at a lab's end too)
            say(f"stage {place.stage}: {over}; leaving now")
            return  # nothing will call it again: no micro-batch or gradient of it is awaited
        if await others_serving(place, state, router):
            break
        if not told:
            say(
                f"stage {place.stage}: no other peer serves this stage; leaving now would stop run {place.run_id!r}. "
                "Waiting for one to join (Ctrl-C again to leave now)"
            )
            told = True
        await asyncio.sleep(place.settings.dht.announce_every_s)
        if state.runtime is None:  # the run left it out meanwhile
            return
    state.leave()
    peer.events.add("leave", f"stage {place.stage}: leaving after this step (draining)")
    announced = time.monotonic()
    peer.changed()
    say(
        f"stage {place.stage}: leaving after this step (finishing the micro-batches and gradients it holds;"
        " Ctrl-C again to leave now)"
    )
    settings = place.settings
    while time.monotonic() - rounds.last_s < settings.calls.call_timeout_s:  # a run gone quiet takes nothing
        if state.runtime is None or (rounds.told_leaving and not meters.queue and state.nothing_unshared()):
            break  # the trainer has its last apply reply (leaving) and will not count on it again
        await asyncio.sleep(POLL_S)
    # its last apply reply is built, not yet delivered (a shaped link delays it): a peer that closed
    # its connections at once could leave the trainer with a failed round instead of its goodbye
    grace = REPLY_GRACE_S if rounds.told_leaving else 0.0
    await asyncio.sleep(max(grace, announced + settings.dht.lookup_every_s - time.monotonic()))
