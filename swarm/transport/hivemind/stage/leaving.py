"""Leaving a run without the run noticing (a stage peer's SIGTERM or Ctrl-C).

The peer first waits until another peer of its stage is in service: without one the run would
have to stop. Then its record says it is leaving (routers stop choosing it) and it refuses new
micro-batches with UNAVAILABLE (their senders retry on another peer of the stage), finishes the
micro-batches it holds, and stays until a step's apply round has taken the gradients it holds:
its apply reply tells the trainer to leave it out from the next step on. It then still refuses
micro-batches until the routers that saw its old record have looked again, so none is sent to a
peer that is gone. A peer holding nothing (between runs, not set up, still joining) or whose run
has been quiet for a call timeout leaves at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

REPLY_GRACE_S = 1.0  # after its last apply reply, for the reply to reach the trainer
POLL_S = 0.05


async def others_serving(host) -> list[str]:
    """The stage's other peers in service for the same trainer session (the DHT's view)."""
    records = await host.router.peers(host.stage, refresh=True)
    return [
        r.peer_id
        for r in records
        if r.ready and not r.leaving and r.session == host.session_id and r.peer_id != host.node.peer_id
    ]


async def drain(host, say: Callable[[str], None]) -> None:
    """Returns once `host` (a `HostedStage`) can leave without its run noticing."""
    if host.runtime is None or host.joining is not None:
        return
    told = False
    while not await others_serving(host):
        if not told:
            say(
                f"stage {host.stage}: no other peer serves this stage; leaving now would stop run {host.run_id!r}. "
                "Waiting for one to join (Ctrl-C again to leave now)"
            )
            told = True
        await asyncio.sleep(host.settings.announce_every_s)
        if host.runtime is None:  # the run left it out meanwhile
            return
    host.leaving = True
    host.events.add("leave", f"stage {host.stage}: leaving after this step (draining)")
    announced = time.monotonic()
    host.changed()
    say(f"stage {host.stage}: leaving after this step (finishing the micro-batches and gradients it holds)")
    settings = host.settings
    while time.monotonic() - host.rounds.last_s < settings.call_timeout_s:  # a run gone quiet takes nothing
        if host.runtime is None or (host.rounds.told_leaving and not host.queue and not host.runtime.held):
            break  # the trainer has its last apply reply (leaving) and will not count on it again
        await asyncio.sleep(POLL_S)
    # its last apply reply is built, not yet delivered (a shaped link delays it): a peer that closed
    # its connections at once could leave the trainer with a failed round instead of its goodbye
    grace = REPLY_GRACE_S if host.rounds.told_leaving else 0.0
    await asyncio.sleep(max(grace, announced + settings.lookup_every_s - time.monotonic()))
