"""Joining a run mid-way: a new stage peer takes the stage's state from a peer in service.

The trainer sets the joiner up at a step boundary, naming the stage's peers in service as its
`sources`, and from then on sends it every step's set_grads and apply rounds as it sends them to
any replica. Until its state is installed the joiner keeps those rounds (`Joining.kept`). It
downloads the state from one source (`StateSource`: a stage file without link ends, taken on the
source's computing thread between two of its rounds, hence at a step boundary), installs it, and
replays the kept rounds of the steps that state had not taken yet. Its weights, optimizer and
schedule then equal every replica's, and it goes into service: its DHT record says ready, and the
peers before it route micro-batches to it. Its links start fresh with each neighbour, as every
new pair of peers does (link state belongs to the pair).

With an asynchronous schedule (swarm.engine.delay) the trainer admits a joiner only where the
pipeline drained and waits until it serves (trainer.setups): the state it downloads is a
checkpoint's, the last step's gradients held unapplied included (StageState.saved), and it keeps no
round meanwhile.

A source serves one download at a time (a joiner that finds it busy tries another source, or the
same later); a download that fails (the source died, a chunk's checksum failed, the stream broke)
is tried on the next source. The payload travels in checksummed chunks (protocols.framing).
"""

from __future__ import annotations

import asyncio
import io
import logging
import random
import time

import torch

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError, one_line
from protocols.stubs import STUBS
from swarm.config import ExperimentConfig
from swarm.engine.checkpoint import apply_stage_state, read_stage, stage_state
from swarm.engine.linkend import LinkEnds
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.stage.codecs import switched_config
from swarm.transport.hivemind.stage.links import NeighbourLinks
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.rounds import StageRounds
from swarm.transport.hivemind.stage.state import StagePlace, StageState, leave_session
from swarm.transport.hivemind.stage.work import StageWork

log = logging.getLogger(__name__)
NO_ENDS = LinkEnds(None, None)


def stage_codecs(place: StagePlace, cfg: ExperimentConfig) -> list[pb.BoundaryCodecs]:
    """The codecs in force (`cfg`: adaptive compression may have changed them) on the stage's boundaries."""
    codecs = []
    for boundary in (place.stage - 1, place.stage):
        if 0 <= boundary < place.num_stages - 1:
            link = cfg.compression.link(boundary)
            codecs.append(pb.BoundaryCodecs(boundary=boundary, forward=link.forward, backward=link.backward))
    return codecs


class StateSource:
    """A stage in service hands its state to joiners, one download at a time."""

    def __init__(self, place: StagePlace, state: StageState, work: StageWork) -> None:
        self.place, self.state, self.work = place, state, work
        self.busy = False
        self.served = 0
        self.bytes_out = 0

    async def serve(self) -> tuple[pb.StateReply, bytes]:
        """The state now; the caller must call `done()` once its reply is written."""
        stage = self.place.stage
        self.state.ready()
        if self.state.joining is not None:
            raise RemoteError(f"stage {stage} peer is joining itself: it has no state to give", pb.UNAVAILABLE)
        if self.busy:
            raise RemoteError(f"stage {stage} peer is serving another joiner's download", pb.UNAVAILABLE)
        self.busy = True
        try:
            return await self.work.run(self._snapshot)
        except BaseException:
            self.busy = False
            raise

    def _snapshot(self) -> tuple[pb.StateReply, bytes]:
        state = self.state
        buffer = io.BytesIO()
        if state.runtime.delay is not None:  # asynchronous: drained (trainer.setups), the last step's
            # gradients held unapplied, as a checkpoint holds them; the joiner applies them with us
            step = state.steps + 1  # the loop's steps (StageState.drained)
            saved = state.saved(NO_ENDS, step, in_flight=True)
            # and the held step's tied parameters' totals, which its held round made before the
            # joiner was there (a checkpoint has none: a restore makes them again by a round)
            saved["tied"] = state.tied_sums(state.steps)
        else:
            step, saved = state.steps, stage_state(state.runtime, NO_ENDS, state.steps, in_flight=True)
        torch.save(saved, buffer)
        return pb.StateReply(step=step, codecs=stage_codecs(self.place, state.cfg)), buffer.getvalue()

    def done(self, sent: int) -> None:
        self.busy = False
        if sent:
            self.served += 1
            self.bytes_out += sent


class Joining:
    """A joiner's catching up: the rounds it keeps, the download, the install and the replay."""

    def __init__(self, parts: StageParts, rounds: StageRounds) -> None:
        self.place, self.state, self.work, self.links = parts.place, parts.state, parts.work, parts.links
        self.gate, self.peer, self.rounds = parts.gate, parts.peer, rounds
        self.sources: list[str] = []
        self.kept: list[tuple[str, object, bytes]] = []  # (kind, head, payload) in arrival order
        self.bytes_in = 0
        self.seconds = 0.0
        self.task: asyncio.Task | None = None

    def start(self, sources: list[str]) -> None:
        self.sources = list(sources)
        self.task = asyncio.create_task(self._run())

    def cancel(self) -> None:
        """Stops the download (from any thread: a test's, the computing thread or the peer's own
        loop), unless it is the caller itself (its own failure ends it anyway)."""
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no loop running in this thread
            current = None
        if self.task is not None and self.task is not current:
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)

    def keep(self, kind: str, head, payload: bytes) -> None:
        """A round that arrived before the state (on the computing thread, in arrival order)."""
        self.kept.append((kind, head, payload))

    async def _run(self) -> None:
        """Sources in turn until one gives the state: busy or failed ones are tried again after a
        growing pause, for at most `state_timeout_s` in all."""
        place, settings = self.place, self.place.settings
        started = time.monotonic()
        tried: set[str] = set()
        pause = settings.retries.backoff_s
        while time.monotonic() - started < settings.calls.state_timeout_s:
            for source in self._candidates():
                tried.add(source[-8:])
                try:
                    frame = await ask(
                        place.node.streams,
                        source,
                        STUBS.state.of(self.gate.state_request(to=address(place.run_id, place.stage))),
                        settings.calls.state_timeout_s,
                    )
                except (TransportError, RemoteError) as e:
                    busy = isinstance(e, RemoteError) and e.other_peer  # serving another joiner
                    level = logging.INFO if busy else logging.WARNING
                    log.log(level, "stage %d: state download from %s: %s", place.stage, source[-8:], one_line(e))
                    continue
                await self._installed(frame, source, started)
                return
            await asyncio.sleep(pause)
            pause = min(2 * pause, settings.dht.announce_every_s)
        self._abandon(
            f"no source gave the stage's state in {settings.calls.state_timeout_s:.0f}s (tried {', '.join(sorted(tried)) or 'none'})"
        )

    def _abandon(self, reason: str) -> None:
        if self.state.joining is self:  # else a restore or a new session came first
            leave_session(self.place, self.state, self.peer, reason)

    async def _installed(self, frame, source: str, started: float) -> None:
        self.bytes_in += len(frame.payload)
        try:
            installed = await self.work.run(self._install, frame.head, frame.payload)
        except Exception as e:
            self._abandon(f"the downloaded state did not install: {one_line(e)}")
            return
        if not installed:
            return
        self.seconds = time.monotonic() - started
        self.state.caught_up(int(frame.head.step), self.bytes_in, self.seconds)
        self.peer.events.add(
            "join",
            f"stage {self.place.stage}: joined with the state of step {frame.head.step} from {source[-8:]} "
            f"({len(frame.payload)} bytes, {self.seconds:.1f}s)",
            logger=log,
        )
        self.peer.changed()

    def _candidates(self) -> list[str]:
        """The sources the owner named in its signed setup (the stage's members in service then), in
        a random order. Never a DHT record's word: any peer can announce itself ready in the session
        and offer weights of its own."""
        return [source for source in random.sample(self.sources, len(self.sources)) if source != self.place.peer_id]

    def _install(self, reply: pb.StateReply, payload: bytes) -> bool:
        """On the computing thread: the state, then the kept rounds of the steps after it; False
        when a restore or a new session came first."""
        state = self.state
        if state.joining is not self:
            return False
        step = install_state(self.place, state, self.links, payload, reply.codecs, "joined")["step"]
        self.rounds.restart()
        state.caught_up(step, self.bytes_in, 0.0)  # the rounds below run as a replica's
        for kind, head, kept_payload in self.kept:
            if head.step >= step:
                self.rounds.run(kind, head, kept_payload)
        self.kept.clear()
        return True


def install_state(
    place: StagePlace, state: StageState, links: NeighbourLinks, payload: bytes, codecs, label: str
) -> dict:
    """On the computing thread: a stage file (`payload`) taken with `codecs` in force, installed
    into the stage's runtime. Every link restarts (a new epoch); the link ends the file carries (the
    swarm's copies keep those in use) go to the first neighbour on each side, the others start
    fresh. The state read."""
    saved = read_stage(io.BytesIO(payload), state.runtime.device)
    cfg = switched_config(state.configured, place.stage, codecs)[0]
    ends = links.fresh(label, cfg)
    carried = LinkEnds(
        *(end if saved.get(side) is not None else None for end, side in zip(ends, ("inbound", "outbound"), strict=True))
    )
    step = apply_stage_state(state.runtime, carried, saved)
    for end in carried:
        if end is not None:  # what the links carried is counted once: in the ends they replace
            end.bytes.clear()
            end.raw.clear()
    links.restore(ends)
    state.restored(cfg, step)
    if saved.get("tied"):  # a joiner's download of an asynchronous step (StateSource)
        state.keep_tied(step - 1, saved["tied"])
    return saved
