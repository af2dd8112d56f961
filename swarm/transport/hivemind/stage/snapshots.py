"""The swarm's copies of every stage's state: what lets a run go on after it lost a stage's last
peer, or its trainer.

Every few steps the trainer's snapshot round reaches every stage peer in service at a step
boundary. Each keeps a copy of its own state (a stage file without link ends, with its RNG and the
trainer's position in its data), and the peers told to hold a neighbour stage's copy fetch it from
that stage's peers in the background: every stage's state then lives on at least two machines. A
peer keeps the copies of the newest `KEEP` steps of each stage it has copies of.

When a stage loses its last peer, or a new trainer resumes the run, every stage goes back to the
newest step of which the swarm holds a copy of every stage (`restore`): a peer that has the copy
installs it, a new one downloads it from a peer that holds it. Copies belong to a lineage (the
trainer session that started the run): copies of another lineage are dropped when a round of a new
one arrives, and a restored trainer carries on the lineage it restored.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from dataclasses import dataclass, field

import torch

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError, one_line
from protocols.stubs import STUBS
from swarm.engine.checkpoint import read_stage
from swarm.transport.hivemind.flow.background import COPY_SHARE, copy_flow
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.stage.joining import NO_ENDS, install_state, stage_codecs
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.rounds import StageRounds
from swarm.transport.hivemind.trust import manifests

log = logging.getLogger(__name__)
KEEP = 2  # newest steps kept per stage: a restore needs one step every stage has, and a round may fail half-way


@dataclass
class Copy:
    stage: int
    step: int
    payload: bytes  # a stage file without link ends, with "rng" and "trainer" (the position) in it
    codecs: list = field(default_factory=list)  # pb.BoundaryCodecs in force when it was taken
    taken: float = field(default_factory=time.monotonic)
    sha256: bytes = b""  # of `payload` (the owner's manifest lists it), hashed on the computing thread
    weights: bytes = b""  # manifests.weights_digest of what it holds, once known (replicas hold it alike)


class Snapshots:
    """The copies one hosted stage keeps, and its snapshot and restore rounds."""

    def __init__(self, parts: StageParts, rounds: StageRounds) -> None:
        self.place, self.state, self.work, self.links = parts.place, parts.state, parts.work, parts.links
        self.handoff, self.gate, self.peer, self.rounds = parts.handoff, parts.gate, parts.peer, rounds
        self.lineage = ""
        self.copies: dict[tuple[int, int], Copy] = {}  # (stage, step) -> copy
        self.restores = 0
        self.restored_step = 0
        self.paused_s = 0.0
        self._fetches: dict[tuple[int, int], asyncio.Task] = {}
        self.manifests = manifests.Kept(self.place.run_id)  # the owner's word of which copies are the swarm's
        self.sending = copy_flow(self.place.node.uplink_bits)  # copies to holders, below the payloads (or None)

    # ---- the snapshot round --------------------------------------------------------------------

    async def snapshot(self, head: pb.SnapshotRequest, payload: bytes) -> tuple[pb.SnapshotReply, bytes]:
        if head.discard:
            if head.lineage == self.lineage:
                self._clear()
            return pb.SnapshotReply(), b""
        if head.HasField("manifest"):  # after the round: which copies it took, signed
            self.manifests.keep(head.manifest, self.gate.owner, self.lineage)
            return pb.SnapshotReply(), b""
        self.state.ready()
        self._adopt(head.lineage)
        step = int(head.step)
        own = self.copies.get((self.place.stage, step))
        if own is None:
            own = await self.work.run(self._take, step, payload)
            self._keep(own)
        for order in head.hold:
            self._fetch(int(order.stage), step, list(order.sources), frozenset(order.accepted), order.weights_sha256)
        paced = self.sending.rate_bits if self.sending is not None else 0.0  # the trainer spaces rounds by it
        return (
            pb.SnapshotReply(
                bytes=len(own.payload), sha256=own.sha256, weights_sha256=own.weights, background_bits=paced
            ),
            b"",
        )

    def _take(self, step: int, trainer: bytes) -> Copy:
        """On the computing thread, between two steps' rounds: this stage's state now."""
        state, stage = self.state, self.place.stage
        if state.joining is not None or state.steps != state.drained(step):
            raise RemoteError(
                f"stage {stage} peer is {state.role} at step {state.steps}: no copy of step {step}", pb.UNAVAILABLE
            )
        # the link ends in use go with it (error feedback state carries on after a restore), unless a
        # micro-batch of an abandoned attempt is still inside, or AQ-SGD rows live in a file on
        # this disk (compression.store_dir): then the links restart fresh
        sticky = self.handoff.sticky if self.handoff is not None else None
        carry = not state.runtime.pending and state.cfg.compression.store_dir is None
        ends = self.links.in_use(sticky) if carry else NO_ENDS
        saved = state.saved(ends, step, in_flight=True)
        saved["rng"] = torch.get_rng_state()
        saved["trainer"] = torch.frombuffer(bytearray(trainer), dtype=torch.uint8) if trainer else None
        saved[manifests.PARAMETERS] = sorted(name for name, _ in state.runtime.module.named_parameters())
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        payload = buffer.getvalue()
        weights = manifests.weights_digest(saved)
        codecs = stage_codecs(self.place, state.cfg)
        return Copy(stage, step, payload, codecs, sha256=manifests.digest(payload), weights=weights)

    @staticmethod
    def _weights_of(copy: Copy) -> bytes:
        """On the computing thread: the digest of the parameters and optimizer state in `copy`, kept
        with it."""
        if not copy.weights:
            copy.weights = manifests.weights_digest(read_stage(io.BytesIO(copy.payload)))
        return copy.weights

    async def _named(self, copy: Copy, accepted: frozenset, weights: bytes) -> str | None:
        """Why `copy` is not one the owner's manifest names (its SHA-256 in `accepted`, its weights
        `weights`, each when given), or None."""
        if accepted and copy.sha256 not in accepted:
            return "its copy is not one the owner's manifest names"
        if weights:
            try:
                held = await self.work.run(self._weights_of, copy)
            except ValueError as e:
                return f"its copy does not read: {one_line(e, 120)}"
            if held != weights:
                return "its copy holds weights other than those its stage's peers agreed on"
        return None

    def _fetch(self, stage: int, step: int, sources: list[str], accepted: frozenset, weights: bytes) -> None:
        """A neighbour stage's copy of `step`, fetched in the background (unless held or on its way)."""
        key = (stage, step)
        if key in self.copies or (key in self._fetches and not self._fetches[key].done()):
            return
        task = asyncio.get_running_loop().create_task(
            self._download(stage, step, [(p, stage) for p in sources], accepted, weights, background=True)
        )
        self._fetches[key] = task
        task.add_done_callback(lambda t, key=key: self._fetched(key, t))

    def _fetched(self, key: tuple[int, int], task: asyncio.Task) -> None:
        if self._fetches.get(key) is task:
            del self._fetches[key]
        if task.cancelled() or not self.lineage:  # cancelled, or every copy dropped meanwhile
            return
        error = task.exception()
        if error is not None:
            log.warning("stage %d: no copy of stage %d at step %d held: %s", self.place.stage, *key, one_line(error))
        else:
            self._keep(task.result())

    async def _download(
        self,
        stage: int,
        step: int,
        sources: list[tuple[str, int]],
        accepted: frozenset = frozenset(),
        weights: bytes = b"",
        background: bool = False,
    ) -> Copy:
        """The copy of `stage` at `step` from the first of `sources` (peer, the stage it hosts) that
        has it (one the owner's manifest names: `_named`); `background`: a holder's fetch, which the
        source sends at its uplink's copy share (flow.background), hence given that much longer."""
        place, errors = self.place, []
        timeout = place.settings.calls.state_timeout_s / (COPY_SHARE if background else 1.0)
        for peer, hosted_stage in sources:
            request = self.gate.state_request(
                to=address(place.run_id, hosted_stage), snapshot=True, stage=stage, step=step, background=background
            )
            try:
                frame = await ask(place.node.streams, peer, STUBS.state.of(request), timeout)
            except (TransportError, RemoteError) as e:
                errors.append(f"{peer[-8:]}: {one_line(e, 120)}")
                continue
            sha256 = await self.work.run(manifests.digest, frame.payload)  # gigabytes: not on the loop
            copy = Copy(stage, step, frame.payload, list(frame.head.codecs), sha256=sha256)
            if (why := await self._named(copy, accepted, weights)) is not None:
                errors.append(f"{peer[-8:]}: {why}")
                continue
            return copy
        raise RemoteError(
            f"no copy of stage {stage} at step {step} from {len(sources)} source(s) ({'; '.join(errors)})",
            pb.UNAVAILABLE,
        )

    # ---- serving a copy ------------------------------------------------------------------------

    def serve(self, head: pb.StateRequest) -> tuple[pb.StateReply, bytes]:
        """The copy `head` asks for (sent paced by `paced(head)`)."""
        copy = self.copies.get((int(head.stage), int(head.step)))
        if copy is None:
            raise RemoteError(
                f"this peer has no copy of stage {head.stage} at step {head.step} (it has {self.describe() or 'none'})",
                pb.UNAVAILABLE,
            )
        return pb.StateReply(step=copy.step, codecs=copy.codecs), copy.payload

    def paced(self, head: pb.StateRequest):
        """The flow a copy asked for by `head` is sent at: a holder's fetch below the payloads, a
        restore's download (the run waits for it) at once."""
        return self.sending if head.background else None

    # ---- the restore round ---------------------------------------------------------------------

    async def restore(self, head: pb.RestoreRequest, payload: bytes) -> tuple[pb.RestoreReply, bytes]:
        place = self.place
        self.state.ready()
        step = int(head.step)
        self._adopt(head.lineage)  # a trainer carries on a lineage of this peer's copies, or starts one
        accepted, weights = frozenset(head.accepted), bytes(head.weights_sha256)
        copy = self.copies.get((place.stage, step))
        if copy is None or await self._named(copy, accepted, weights) is not None:
            sources = [(s.peer_id, int(s.stage)) for s in head.sources if s.peer_id != place.peer_id]
            copy = await self._download(place.stage, step, sources, accepted, weights)
            self._keep(copy)
        trainer = await self.work.run(self._install, copy)
        for key in [key for key in self.copies if key[1] > step]:  # the run goes on from `step`
            del self.copies[key]
        for key, task in list(self._fetches.items()):
            if key[1] > step:
                task.cancel()
        self.restores += 1
        self.restored_step, self.paused_s = step, float(head.paused_s)
        self.peer.events.add(
            "resume",
            f"stage {place.stage}: went back to the copy of step {step} after a {self.paused_s:.1f}s pause",
            logger=log,
        )
        self.peer.changed()
        return pb.RestoreReply(step=step), trainer

    def _install(self, copy: Copy) -> bytes:
        self.state.stop_joining()  # the copy is the state it was waiting for
        saved = install_state(self.place, self.state, self.links, copy.payload, copy.codecs, "restored")
        self.rounds.restart()
        if isinstance(saved.get("rng"), torch.Tensor):
            torch.set_rng_state(saved["rng"])
        trainer = saved.get("trainer")
        return bytes(trainer.numpy().tobytes()) if isinstance(trainer, torch.Tensor) else b""

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _adopt(self, lineage: str) -> None:
        if lineage != self.lineage:
            self._clear()
            self.lineage = lineage

    def _keep(self, copy: Copy) -> None:
        self.copies[(copy.stage, copy.step)] = copy
        steps = sorted(step for stage, step in self.copies if stage == copy.stage)
        for old in steps[:-KEEP]:
            del self.copies[(copy.stage, old)]

    def _clear(self) -> None:
        self.copies.clear()
        self.manifests.clear()
        for task in self._fetches.values():
            task.cancel()
        self._fetches.clear()
        self.lineage = ""

    def describe(self) -> str:
        return ", ".join(f"stage {stage} step {step}" for stage, step in sorted(self.copies))

    def status(self, out: pb.StageStatus) -> None:
        now = time.monotonic()
        for (stage, step), copy in sorted(self.copies.items()):
            out.snapshots.add(
                stage=stage,
                step=step,
                bytes=len(copy.payload),
                age_s=now - copy.taken,
                lineage=self.lineage,
                sha256=copy.sha256,
            )
        out.manifests.extend(self.manifests.all())
        out.restores, out.restored_step, out.paused_s = self.restores, self.restored_step, self.paused_s

    def close(self) -> None:
        for task in self._fetches.values():
            task.get_loop().call_soon_threadsafe(task.cancel)
