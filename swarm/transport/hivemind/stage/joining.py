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
from swarm.engine.checkpoint import apply_stage_state, read_stage, stage_state
from swarm.engine.linkend import LinkEnds
from swarm.transport.hivemind.calls import call
from swarm.transport.hivemind.errors import RemoteError, TransportError, one_line
from swarm.transport.hivemind.meta import address
from swarm.transport.hivemind.stage.codecs import switched_config

log = logging.getLogger(__name__)
NO_ENDS = LinkEnds(None, None)


def stage_codecs(host) -> list[pb.BoundaryCodecs]:
    """The codecs in force on `host`'s boundaries (adaptive compression may have changed them)."""
    codecs = []
    for boundary in (host.stage - 1, host.stage):
        if 0 <= boundary < host.num_stages - 1:
            link = host.cfg.compression.link(boundary)
            codecs.append(pb.BoundaryCodecs(boundary=boundary, forward=link.forward, backward=link.backward))
    return codecs


class StateSource:
    """A stage in service hands its state to joiners, one download at a time."""

    def __init__(self, host) -> None:
        self.host = host
        self.busy = False
        self.served = 0
        self.bytes_out = 0

    async def serve(self) -> tuple[pb.StateReply, bytes]:
        """The state now; the caller must call `done()` once its reply is written."""
        host = self.host
        host.ready()
        if host.joining is not None:
            raise RemoteError(f"stage {host.stage} peer is joining itself: it has no state to give", pb.UNAVAILABLE)
        if self.busy:
            raise RemoteError(f"stage {host.stage} peer is serving another joiner's download", pb.UNAVAILABLE)
        self.busy = True
        try:
            return await host.compute(self._snapshot)
        except BaseException:
            self.busy = False
            raise

    def _snapshot(self) -> tuple[pb.StateReply, bytes]:
        host = self.host
        buffer = io.BytesIO()
        torch.save(stage_state(host.runtime, NO_ENDS, host.steps, in_flight=True), buffer)
        return pb.StateReply(step=host.steps, codecs=stage_codecs(host)), buffer.getvalue()

    def done(self, sent: int) -> None:
        self.busy = False
        if sent:
            self.served += 1
            self.bytes_out += sent


class Joining:
    """A joiner's catching up: the rounds it keeps, the download, the install and the replay."""

    def __init__(self, host, sources: list[str]) -> None:
        self.host = host
        self.sources = list(sources)
        self.kept: list[tuple[str, object, bytes]] = []  # (kind, head, payload) in arrival order
        self.bytes_in = 0
        self.seconds = 0.0
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    def cancel(self) -> None:
        """Stops the download (from any thread: a test's or the peer's own loop)."""
        if self.task is not None:
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)

    def keep(self, kind: str, head, payload: bytes) -> None:
        """A round that arrived before the state (on the computing thread, in arrival order)."""
        self.kept.append((kind, head, payload))

    async def _run(self) -> None:
        """Sources in turn until one gives the state: busy or failed ones are tried again after a
        growing pause, for at most `state_timeout_s` in all."""
        host, settings = self.host, self.host.settings
        started = time.monotonic()
        tried: set[str] = set()
        pause = settings.backoff_s
        while time.monotonic() - started < settings.state_timeout_s:
            for source in await self._candidates():
                tried.add(source[-8:])
                try:
                    frame = await call(
                        host.node.streams,
                        source,
                        "state",
                        pb.StateRequest(to=address(host.run_id, host.stage), admission=host.gate.shown()),
                        b"",
                        settings.state_timeout_s,
                    )
                except (TransportError, RemoteError) as e:
                    busy = isinstance(e, RemoteError) and e.other_peer  # serving another joiner
                    level = logging.INFO if busy else logging.WARNING
                    log.log(level, "stage %d: state download from %s: %s", host.stage, source[-8:], one_line(e))
                    continue
                await self._installed(frame, source, started)
                return
            await asyncio.sleep(pause)
            pause = min(2 * pause, settings.announce_every_s)
        host.abandon_join(
            f"no source gave the stage's state in {settings.state_timeout_s:.0f}s (tried {', '.join(sorted(tried)) or 'none'})"
        )

    async def _installed(self, frame, source: str, started: float) -> None:
        host = self.host
        self.bytes_in += len(frame.payload)
        try:
            await host.compute(self._install, frame.head, frame.payload)
        except Exception as e:
            host.abandon_join(f"the downloaded state did not install: {one_line(e)}")
            return
        self.seconds = time.monotonic() - started
        host.joined = (int(frame.head.step), self.bytes_in, self.seconds)
        host.events.add(
            "join",
            f"stage {host.stage}: joined with the state of step {frame.head.step} from {source[-8:]} "
            f"({len(frame.payload)} bytes, {self.seconds:.1f}s)",
            logger=log,
        )
        host.changed()

    async def _candidates(self) -> list[str]:
        """The sources named at setup, then the stage's other peers in service (the DHT's view)."""
        host = self.host
        found = [
            r.peer_id
            for r in await host.router.peers(host.stage, refresh=True)
            if r.ready and r.session == host.session_id and r.peer_id != host.node.peer_id
        ]
        named = random.sample(self.sources, len(self.sources))
        return list(dict.fromkeys([*named, *found]))

    def _install(self, reply: pb.StateReply, payload: bytes) -> None:
        """On the computing thread: the state, then the kept rounds of the steps after it."""
        host = self.host
        if host.joining is not self:  # a restore or a new session came first
            return
        step = install_state(host, payload, reply.codecs, "joined")["step"]
        host.joining = None  # the rounds below run as a replica's
        for kind, head, kept_payload in self.kept:
            if head.step >= step:
                getattr(host.rounds, kind)(head, kept_payload)
        self.kept.clear()


def install_state(host, payload: bytes, codecs, label: str) -> dict:
    """On the computing thread: a stage file (`payload`) taken with `codecs` in force, installed
    into `host`'s runtime. Every link restarts (a new epoch); the link ends the file carries (the
    swarm's copies keep those in use) go to the first neighbour on each side, the others start
    fresh. The state read."""
    state = read_stage(io.BytesIO(payload), host.runtime.device)
    cfg = switched_config(host.configured, host.stage, codecs)[0]
    ends = host.fresh_ends(label, cfg)
    carried = LinkEnds(
        *(end if state.get(side) is not None else None for end, side in zip(ends, ("inbound", "outbound"), strict=True))
    )
    step = apply_stage_state(host.runtime, carried, state)
    for end in carried:
        if end is not None:  # what the links carried is counted once: in the ends they replace
            end.bytes.clear()
            end.raw.clear()
    host.restored(cfg, ends, step)
    host.rounds.restart()
    return state
