"""The synchronous step (swarm.engine.step) and checkpoints over the stage peers: each round sent to
every peer set up for the run, each retried on its peer when a reply is lost (rounds are
idempotent there: swarm.transport.hivemind.stage.rounds).

Gathering is where membership meets the step: every peer sums the gradients of the micro-batches
that finished through it (its held gradients of failed attempts never count); a replicated stage's
peers hand over all their gradients and the trainer sums them. A peer that left with micro-batches
of this step makes those run again through the peers still there before the step goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from pathlib import Path

from protocols import stage_pb2 as pb
from protocols.framing import Frame
from swarm.engine.checkpoint import CODECS_FILE, atomic_write, checkpoint_codecs, stage_file
from swarm.engine.step import Grads
from swarm.transport.hivemind.calls import call
from swarm.transport.hivemind.errors import TransportError
from swarm.transport.hivemind.meta import address, payload_to_tensors, tensors_to_payload

log = logging.getLogger(__name__)


class SwarmRounds:
    """The step's rounds of one `SwarmPipeline` (`pipeline`), as `swarm.engine.step.StepRounds`."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline

    async def call(self, stage: int, peer_id: str, kind: str, payload: bytes = b"", **fields) -> Frame:
        """One round on one peer, retried there when its reply is lost."""
        p = self.pipeline
        head = getattr(pb, _REQUESTS[kind])(to=address(p.run_id, stage), **fields)
        timeout = p.node.settings.call_timeout_s
        return await p.retry.same_peer(
            lambda: call(p.node.streams, peer_id, kind, head, payload, timeout),
            f"{kind} round on stage {stage} peer {peer_id[-8:]}",
        )

    def _peers(self) -> list[tuple[int, str]]:
        members = self.pipeline.members
        return [(stage, peer) for stage in sorted(members) for peer in members[stage]]

    def replicated(self, stage: int) -> bool:
        return len(self.pipeline.members[stage]) > 1

    # ---- round 1: gather ------------------------------------------------------------------------

    def gather(self, wanted: dict[int, list[str]]) -> Grads:
        return self.pipeline.loop.run(self._gather(wanted))

    async def _gather_on(self, stage: int, peer: str, indices: list[int], wanted: list[str]) -> Frame:
        replicated = self.replicated(stage)
        return await self.call(
            stage,
            peer,
            "gather",
            step=self.pipeline.step_index,
            micro_batches=sorted(indices),
            all_grads=replicated,
            grads=[] if replicated else wanted,
        )

    async def _gather(self, wanted: dict[int, list[str]]) -> Grads:
        p = self.pipeline
        for _ in range(p.node.settings.attempts):
            counted: dict[tuple[int, str], list[int]] = defaultdict(list)
            for index, route in p.routes.items():
                for stage, peer in enumerate(route):
                    counted[(stage, peer)].append(index)
            peers = self._peers()
            replies = await asyncio.gather(
                *(self._gather_on(s, peer, counted.get((s, peer), []), wanted.get(s, [])) for s, peer in peers),
                return_exceptions=True,
            )
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, TransportError):
                    raise reply
            lost = [(s, peer, r) for (s, peer), r in zip(peers, replies, strict=True) if isinstance(r, TransportError)]
            if not lost:
                break
            rerun = sorted({i for s, peer, _ in lost for i in counted.get((s, peer), [])})
            for stage, peer, error in lost:
                if len(p.members[stage]) <= 1:
                    raise error
                p.members[stage].remove(peer)
                p.router.failed(peer)
                log.warning(
                    "stage %d peer %s left the run (%s); re-running its micro-batches %s",
                    stage,
                    peer[-8:],
                    error,
                    rerun,
                )
            if rerun:
                await p.run_again(rerun)
        else:
            raise RuntimeError(f"step {p.step_index}: stage peers kept leaving while gathering gradients")
        combined: Grads = defaultdict(dict)
        for (stage, _), frame in zip(peers, replies, strict=True):
            for name, grad in payload_to_tensors(frame.head.grads, frame.payload).items():
                total = combined[stage].get(name)
                combined[stage][name] = grad if total is None else total + grad
        return combined

    # ---- round 2: set the combined gradients, read the norm ---------------------------------------

    def set_gradients(self, grads: Grads, norm: bool) -> float:
        members = self.pipeline.members

        async def one(stage: int, peer: str) -> Frame:
            slots, data = tensors_to_payload(grads.get(stage, {}))
            first = peer == members[stage][0]  # replicas hold the same sum: one norm per stage
            return await self.call(
                stage, peer, "set_grads", data, step=self.pipeline.step_index, grads=slots, norm=norm and first
            )

        async def run() -> float:
            replies = await asyncio.gather(*(one(s, peer) for s, peer in self._peers()))
            return sum(frame.head.grad_sq_norm for frame in replies)

        return self.pipeline.loop.run(run())

    # ---- round 3: apply -------------------------------------------------------------------------

    def apply(self, scale: float) -> float:
        p = self.pipeline

        async def run() -> float:
            codecs = await p.adapt()
            replies = await asyncio.gather(
                *(
                    self.call(s, peer, "apply", step=p.step_index, scale=scale, codecs=codecs)
                    for s, peer in self._peers()
                )
            )
            return replies[0].head.lr

        lr = p.loop.run(run())
        p.step_done()
        return lr

    # ---- checkpoints: the stage files, fetched from and installed on the peers ---------------------

    async def save(self, directory: Path, step: int) -> None:
        """`stage<i>.pt` per stage, fetched from the stage's first peer (replicas hold the same weights)."""
        p = self.pipeline

        async def one(stage: int):
            frame = await self.call(stage, p.members[stage][0], "save", step=step)
            atomic_write(stage_file(directory, stage), lambda f: f.write(frame.payload))

        await asyncio.gather(*(one(s) for s in range(p.num_stages)))
        if p.adaptive is not None:  # the links' saved state belongs to these codecs
            atomic_write(directory / CODECS_FILE, lambda f: f.write(p.adaptive.saved().encode()))

    async def load(self, directory: Path) -> tuple[int, dict | None]:
        """Installs every `stage<i>.pt` on every peer of that stage; the step, and what an adaptive
        run saved of its codecs."""
        p = self.pipeline
        blobs = {}
        for stage in range(p.num_stages):
            path = stage_file(directory, stage)
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {directory} has no {path.name}")
            blobs[stage] = path.read_bytes()
        saved = checkpoint_codecs(directory, adaptive=p.adaptive is not None)
        codecs = [] if saved is None else codec_changes(saved["codecs"])
        replies = await asyncio.gather(
            *(self.call(s, peer, "load", blobs[s], codecs=codecs) for s, peer in self._peers())
        )
        steps = {int(frame.head.step) for frame in replies}
        if len(steps) != 1:
            raise ValueError(f"checkpoint {directory} mixes stages saved at steps {sorted(steps)}")
        return steps.pop(), saved


def codec_changes(codecs: dict[int, tuple[str, str]]) -> list[pb.BoundaryCodecs]:
    return [pb.BoundaryCodecs(boundary=b, forward=fw, backward=bw) for b, (fw, bw) in sorted(codecs.items())]


_REQUESTS = {
    "gather": "GatherRequest",
    "set_grads": "SetGradsRequest",
    "apply": "ApplyRequest",
    "save": "SaveRequest",
    "load": "LoadRequest",
}
