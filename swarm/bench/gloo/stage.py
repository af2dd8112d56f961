"""A stage's rank of the gloo baseline: the engine's stage runtime, driven by messages.

Rank 0 is the trainer, stage i is rank i + 1. Every message is a tuple whose first item says what
it is: `forward` and `backward` carry a micro-batch and its boundary payload (the `none` codec's
bytes: the tensor uncompressed; parsed here, at the transport's edge, as a stage peer of the swarm
parses what it receives), the step's rounds come from the trainer (`gather`, `set`,
`apply`), and `stop` ends the loop. Gradients are held per micro-batch and summed in micro-batch
order, as a stage peer of the swarm sums them, so the losses are the one-process run's.
"""

from __future__ import annotations

import time

from protocols import wire
from swarm.bench.gloo.mailbox import Mailbox
from swarm.config import ExperimentConfig
from swarm.engine.build import build_runtime, build_staged_model, link_ends
from swarm.engine.microbatch import Kind, Message, Mode

TRAINER = 0


def rank_of(stage: int) -> int:
    return stage + 1


def neighbours(stage: int, stages: int) -> list[int]:
    """The ranks a stage exchanges messages with: the trainer and the stages next to it."""
    return [TRAINER, *(rank_of(s) for s in (stage - 1, stage + 1) if 0 <= s < stages)]


class StageRank:
    def __init__(self, cfg: ExperimentConfig, stage: int, mailbox: Mailbox, total_steps: int) -> None:
        staged = build_staged_model(cfg)
        self.stage, self.mailbox = stage, mailbox
        self.runtime = build_runtime(cfg, staged, stage, total_steps, hold_grads=True)
        self.ends = link_ends(cfg, stage)
        self.compute_s = self.compute_cpu_s = 0.0
        self.samples = 0  # training samples through this stage's forward

    def serve(self) -> None:
        """Until the trainer says stop."""
        while True:
            _, message = self.mailbox.receive()
            kind, args = message[0], message[1:]
            if kind == "stop":
                self.mailbox.send(TRAINER, ("stopped", self.stage))
                self.mailbox.flush()
                return
            if kind in ("forward", "backward"):
                self._compute(kind, *args)
            else:
                self.mailbox.send(TRAINER, (kind, self.stage, getattr(self, f"_{kind}")(*args)))

    def _compute(self, kind: str, batch, payload, metrics=None) -> None:
        """Training's compute only is counted, as a swarm's stage peer counts it (its ComputeClock):
        evaluation forwards would lower the compute bound the benchmark divides by."""
        began, began_cpu = time.perf_counter(), time.thread_time()
        if kind == "forward":  # stage 0's is the micro-batch's input tensor
            out = self.runtime.forward(batch, payload if self.stage == 0 else wire.decode(payload), self.ends)
        else:
            out = self.runtime.backward(batch, wire.decode(payload), metrics, self.ends)
        if batch.mode is Mode.TRAIN:
            self.samples += batch.size if kind == "forward" else 0
            self.compute_s += time.perf_counter() - began
            self.compute_cpu_s += time.thread_time() - began_cpu
        self._route(out)

    def _route(self, out: Message) -> None:
        if out.kind is Kind.FORWARD:
            self.mailbox.send(rank_of(out.to_stage), ("forward", out.batch, out.payload))
        elif out.kind is Kind.BACKWARD:
            self.mailbox.send(rank_of(out.to_stage), ("backward", out.batch, out.payload, out.metrics))
        else:
            self.mailbox.send(TRAINER, ("done", out.batch.key, out.metrics))
        out.delivered()  # the none codec keeps no state: nothing waits on the transfer

    # ---- the step's rounds (swarm.engine.step), asked by the trainer ------------------------------

    def _gather(self, names: list[str], keys: list[tuple]) -> dict:
        self.runtime.accumulate(keys)
        return self.runtime.gradients(names) if names else {}

    def _set(self, grads: dict, norm: bool) -> float:
        if grads:
            self.runtime.set_gradients(grads)
        return self.runtime.grad_sq_norm() if norm else 0.0

    def _apply(self, scale: float) -> dict:
        if scale:
            self.runtime.scale_grads(scale)
        lr = self.runtime.apply_step()
        bytes_sent = {
            f"boundary{end.boundary}.{direction}.{mode}": n
            for end in self.ends
            if end is not None
            for (mode, direction), n in end.bytes.items()
        }
        totals = {"compute_s": self.compute_s, "compute_cpu_s": self.compute_cpu_s, "samples": self.samples}
        return {"lr": lr, "bytes": bytes_sent, "totals": totals}
