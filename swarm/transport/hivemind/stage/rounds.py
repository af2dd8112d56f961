"""A stage peer's part of the synchronous step (swarm.engine.step) and of checkpoints: one handler
per request, each run on the stage's computing thread (its time counts as the stage's compute).

Every round is idempotent, so the trainer may simply retry one whose reply was lost: gathering
sums the held gradients again (they stay until the optimizer steps; with new averaging groups:
swarm.transport.hivemind.stage.combine), setting gradients sets the same ones, and a retried apply
returns the reply of the apply it repeats. Rounds are of one step:
a peer whose weights are at another step refuses them (it missed a round). A peer joining mid-run
keeps its rounds until its state is installed (swarm.transport.hivemind.stage.joining).
"""

from __future__ import annotations

import io
import math
import time

import torch

from protocols import stage_pb2 as pb
from protocols.errors import ProtocolError
from swarm.engine.checkpoint import apply_stage_state, read_stage, stage_state
from swarm.transport.hivemind.errors import RemoteError
from swarm.transport.hivemind.meta import payload_to_tensors
from swarm.transport.hivemind.stage.codecs import switched_config
from swarm.transport.hivemind.stage.combine import Combining


class StageRounds:
    """The step's rounds and checkpoints of one hosted stage (`host`: its `HostedStage`)."""

    def __init__(self, host) -> None:
        self.host = host
        self.applied: tuple[int, pb.ApplyReply] | None = None  # the last apply: (step, its reply)
        self.last_s = time.monotonic()  # when the last round came (a run gone quiet has none)
        self.told_leaving = False  # an apply reply told the trainer this peer leaves (stage.leaving)
        self.combining = Combining(host)  # the gather round: with the peers that share gradients

    def restart(self) -> None:
        self.applied = None

    async def handle(self, kind: str, head, payload: bytes) -> tuple[object, bytes]:
        """The reply (head, payload) to a step round or checkpoint request of `kind`."""
        self.host.ready()
        self.last_s = time.monotonic()
        if kind == "gather":  # computing, and the exchange with the groups in between
            return await self.combining.gather(head)
        return await self.host.compute(self._kept_or_timed, getattr(self, kind), head, payload)

    def _kept_or_timed(self, handler, head, payload: bytes):
        joining = self.host.joining
        if joining is not None and handler.__name__ in ("set_grads", "apply"):
            joining.keep(handler.__name__, head, payload)
            return (pb.SetGradsReply() if handler.__name__ == "set_grads" else pb.ApplyReply(following=True)), b""
        return self.timed(handler, head, payload)

    def timed(self, fn, *args):
        """`fn(*args)` on the computing thread, its time counted as the stage's compute."""
        clock = self.host.clock
        started = clock.start()
        try:
            return fn(*args)
        finally:
            clock.stop(started)

    # ---- the step ----------------------------------------------------------------------------

    def _at(self, step: int, kind: str) -> None:
        host = self.host
        if step != host.steps:
            raise RemoteError(
                f"stage {host.stage} peer is at step {host.steps}, the {kind} round is of step {step}", pb.UNAVAILABLE
            )

    def set_grads(self, head: pb.SetGradsRequest, payload: bytes) -> tuple[pb.SetGradsReply, bytes]:
        self._at(head.step, "set_grads")
        runtime = self.host.runtime
        try:
            runtime.set_gradients(payload_to_tensors(head.grads, payload))
        except (KeyError, ValueError) as e:
            raise ProtocolError(str(e.args[0])) from None
        return pb.SetGradsReply(grad_sq_norm=self.combining.grad_sq_norm() if head.norm else 0.0), b""

    def apply(self, head: pb.ApplyRequest, payload: bytes) -> tuple[pb.ApplyReply, bytes]:
        host = self.host
        if self.applied is not None and self.applied[0] == head.step:
            return self.applied[1], b""
        self._at(head.step, "apply")
        cfg, changed = switched_config(host.cfg, host.stage, head.codecs)  # checked before anything changes
        runtime = host.runtime
        if not (math.isfinite(head.scale) and head.scale >= 0):
            raise ProtocolError(f"gradient scale {head.scale} is not a finite non-negative number")
        if not all(bool(torch.isfinite(p.grad).all()) for p in runtime.module.parameters() if p.grad is not None):
            raise RemoteError(f"stage {host.stage}: non-finite gradients at step {head.step}: the step is not applied")
        if head.scale:
            runtime.scale_grads(head.scale)
        reply = pb.ApplyReply(lr=runtime.apply_step(), leaving=host.leaving)
        self.told_leaving = host.leaving
        host.steps += 1
        self.applied = (head.step, reply)
        if changed:  # adaptive compression: new codecs from the next step on
            host.switch_codecs(cfg, changed)
        return reply, b""

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, head: pb.SaveRequest, payload: bytes) -> tuple[pb.SaveReply, bytes]:
        """This stage as a single-process stage checkpoint, with the links in use as its link ends
        (other neighbours' links restart fresh after a resume) and this process's RNG."""
        host = self.host
        if host.joining is not None:
            raise RemoteError(f"stage {host.stage} peer is still joining: it has no state to save", pb.UNAVAILABLE)
        sticky = host.handoff.sticky if host.handoff is not None else None
        state = stage_state(host.runtime, host.links.in_use(sticky), head.step)
        state["rng"] = torch.get_rng_state()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return pb.SaveReply(), buffer.getvalue()

    def load(self, head: pb.LoadRequest, payload: bytes) -> tuple[pb.LoadReply, bytes]:
        """Installs a stage checkpoint, with the codecs its links ran (adaptive compression; else
        the config's); every link restarts from its saved ends with a new epoch."""
        host = self.host
        cfg = switched_config(host.configured, host.stage, head.codecs)[0]
        try:
            state = read_stage(io.BytesIO(payload), host.runtime.device)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        own = host.fresh_ends("checkpoint", cfg)
        try:
            step = apply_stage_state(host.runtime, own, state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ProtocolError(f"checkpoint does not fit stage {host.stage}: {str(e).splitlines()[0][:200]}") from None
        if isinstance(state.get("rng"), torch.Tensor):
            torch.set_rng_state(state["rng"])
        if host.joining is not None:  # the checkpoint is the state it was waiting for
            host.joining.cancel()
            host.joining = None
        host.restored(cfg, own, step)
        self.applied = None
        return pb.LoadReply(step=step), b""
