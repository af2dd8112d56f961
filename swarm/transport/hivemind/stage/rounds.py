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
from protocols.errors import ProtocolError, RemoteError
from swarm.config import ExperimentConfig
from swarm.engine.checkpoint import apply_stage_state, read_stage
from swarm.engine.stage import step_keys
from swarm.tracing import TRACER
from swarm.transport.hivemind.net.meta import payload_to_tensors
from swarm.transport.hivemind.stage.codecs import switched_config
from swarm.transport.hivemind.stage.combine import Combining
from swarm.transport.hivemind.stage.parts import StageParts


class StageRounds:
    """The step's rounds and checkpoints of one hosted stage."""

    def __init__(self, parts: StageParts) -> None:
        self.place, self.state, self.work, self.links = parts.place, parts.state, parts.work, parts.links
        self.handoff, self.peer = parts.handoff, parts.peer
        # the last apply: ((the state's generation, step), its reply); a state restored to an earlier
        # step is a new generation, whose apply of the same step is a new one
        self.applied: tuple[tuple[int, int], pb.ApplyReply] | None = None
        self.last_s = time.monotonic()  # when the last round came (a run gone quiet has none)
        self.told_leaving = False  # an apply reply told the trainer this peer leaves (stage.leaving)
        self.combining = Combining(
            self.place, self.state, self.work, self.peer
        )  # the gather round: with the peers that share gradients

    def restart(self) -> None:
        self.applied = None

    async def handle(self, kind: str, head, payload: bytes) -> tuple[object, bytes]:
        """The reply (head, payload) to a step round or checkpoint request of `kind`."""
        self.state.ready()
        self.last_s = time.monotonic()
        with TRACER.span(kind, "step", step=int(head.step) if hasattr(head, "step") else -1):
            if kind == GATHER:  # computing, and the exchange with the groups in between
                return await self.combining.gather(head)
            return await self.work.run(self._kept_or_timed, kind, head, payload)

    def _kept_or_timed(self, kind: str, head, payload: bytes):
        joining = self.state.joining
        if joining is not None and kind in KEPT:
            joining.keep(kind, head, payload)
            return KEPT[kind](), b""
        return self.work.timed(ON_THREAD[kind], self, head, payload)  # traced under the round's name

    def run(self, kind: str, head, payload: bytes) -> tuple[object, bytes]:
        """On the computing thread: the round `kind` (one of `ON_THREAD`: a joiner replays its kept
        rounds through it too)."""
        return ON_THREAD[kind](self, head, payload)

    # ---- the step ----------------------------------------------------------------------------

    def set_grads(self, head: pb.SetGradsRequest, payload: bytes) -> tuple[pb.SetGradsReply, bytes]:
        self.state.at(head.step, "the set_grads round")
        try:
            self.state.runtime.set_gradients(payload_to_tensors(head.grads, payload))
        except (KeyError, ValueError) as e:
            raise ProtocolError(str(e.args[0])) from None
        return pb.SetGradsReply(grad_sq_norm=self.combining.grad_sq_norm() if head.norm else 0.0), b""

    def apply(self, head: pb.ApplyRequest, payload: bytes) -> tuple[pb.ApplyReply, bytes]:
        state, stage = self.state, self.place.stage
        cfg, changed = switched_config(state.cfg, stage, head.codecs)  # checked before anything changes
        if self.applied is not None and self.applied[0] == (state.generation, head.step):
            self._switch(cfg, changed)  # an asynchronous run's codecs come with a step applied already
            return self.applied[1], b""
        state.at(head.step, "the apply round")
        runtime = state.runtime
        if not (math.isfinite(head.scale) and head.scale >= 0):
            raise ProtocolError(f"gradient scale {head.scale} is not a finite non-negative number")
        keys = None
        if runtime.delay is not None:  # an asynchronous step is summed when applied (stage.closing)
            keys = step_keys(head.step, state.cfg.train.micro_batches)
            try:  # a replicated stage's step: its replicas' sum (stage.combine)
                runtime.accumulate_step(head.step, state.cfg.train.micro_batches)
            except KeyError as e:
                raise RemoteError(f"stage {stage}: {e.args[0]}: step {head.step} is not applied") from None
            for name, total in state.tied_sums(head.step).items():  # both stages' sum (stage.combine)
                runtime.parameter(name).grad = total.clone()
        if not all(bool(torch.isfinite(p.grad).all()) for p in runtime.module.parameters() if p.grad is not None):
            raise RemoteError(f"stage {stage}: non-finite gradients at step {head.step}: the step is not applied")
        if head.scale:
            runtime.scale_grads(head.scale)
        lr = runtime.apply_step(keys)
        # an asynchronous schedule's leaver still holds later steps' gradients: it says it leaves
        # at the first apply after which its replicas' sums have all of them
        self.told_leaving = state.leaving and state.nothing_unshared()
        reply = pb.ApplyReply(lr=lr, leaving=self.told_leaving)
        state.stepped()
        self.applied = ((state.generation, head.step), reply)
        self._switch(cfg, changed)
        return reply, b""

    def _switch(self, cfg: ExperimentConfig, changed: list[int]) -> None:
        """Adaptive compression: `cfg`'s new codecs on the `changed` boundaries from the next step on
        (the trainer sends them when no micro-batch is in flight)."""
        if not changed:
            return
        self.state.switched(cfg)
        for boundary in changed:
            link = cfg.compression.link(boundary)
            self.peer.events.add("codec", f"boundary {boundary}: {link.forward} forward, {link.backward} backward")
        self.links.switch(changed)

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, head: pb.SaveRequest, payload: bytes) -> tuple[pb.SaveReply, bytes]:
        """This stage as a single-process stage checkpoint, with the links in use as its link ends
        (other neighbours' links restart fresh after a resume) and this process's RNG."""
        state = self.state
        if state.joining is not None:
            raise RemoteError(
                f"stage {self.place.stage} peer is still joining: it has no state to save", pb.UNAVAILABLE
            )
        sticky = self.handoff.sticky if self.handoff is not None else None
        saved = state.saved(self.links.in_use(sticky), head.step)
        saved["rng"] = torch.get_rng_state()
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        return pb.SaveReply(), buffer.getvalue()

    def load(self, head: pb.LoadRequest, payload: bytes) -> tuple[pb.LoadReply, bytes]:
        """Installs a stage checkpoint, with the codecs its links ran (adaptive compression; else
        the config's); every link restarts from its saved ends with a new epoch."""
        state, stage = self.state, self.place.stage
        cfg = switched_config(state.configured, stage, head.codecs)[0]
        try:
            saved = read_stage(io.BytesIO(payload), state.runtime.device)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        own = self.links.fresh("checkpoint", cfg)
        try:
            step = apply_stage_state(state.runtime, own, saved)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ProtocolError(f"checkpoint does not fit stage {stage}: {str(e).splitlines()[0][:200]}") from None
        if isinstance(saved.get("rng"), torch.Tensor):
            torch.set_rng_state(saved["rng"])
        state.stop_joining()  # the checkpoint is the state it was waiting for
        self.links.restore(own)
        state.restored(cfg, step)
        self.applied = None
        return pb.LoadReply(step=step), b""


GATHER = "gather"  # on the loop: its sums wait for the replicas' (stage.combine)
# call kind -> its round on the computing thread (a renamed method fails here, at import)
ON_THREAD = {
    "set_grads": StageRounds.set_grads,
    "apply": StageRounds.apply,
    "save": StageRounds.save,
    "load": StageRounds.load,
}
# the rounds a joiner keeps until its state is installed (stage.joining), and its reply meanwhile
KEPT = {"set_grads": pb.SetGradsReply, "apply": lambda: pb.ApplyReply(following=True)}
ROUNDS = frozenset({GATHER, *ON_THREAD})  # the kinds `StageRounds.handle` serves
