"""The in-process transport: every stage in this process, messages still encoded to bytes.

Micro-batches run one after another (forward through all stages, then backward); with
synchronous steps that is the same computation any schedule performs, and it makes runs
deterministic. Bytes and numerics are exactly what the network would carry: every message is
parsed from its bytes here, at the transport's edge, as a stage peer parses what it receives.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack

import torch

from protocols import wire
from swarm.config import ExperimentConfig
from swarm.engine.build import build_runtime, build_staged_model, link_ends
from swarm.engine.checkpoint import checkpoint_codecs, load_stage, save_stage, stage_file
from swarm.engine.linkend import LinkEnds
from swarm.engine.microbatch import Kind, MicroBatch, Mode
from swarm.engine.stage import StageRuntime
from swarm.engine.step import Grads, synchronous_step
from swarm.models import StagedModel


class LocalPipeline:
    """The engine's `Pipeline` in one process: stage `i` computes with `runtimes[i]` and `ends[i]`."""

    def __init__(
        self, runtimes: list[StageRuntime], ends: list[LinkEnds], tied=(), grad_clip: float | None = None
    ) -> None:
        self.runtimes = runtimes
        self.ends = ends
        self.tied = list(tied)  # TiedPairs: one parameter held by two stages
        self.grad_clip = grad_clip

    def _run(self, batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
        """One micro-batch through the pipeline (and back when training); its metrics."""
        message = self.runtimes[0].forward(batch, inputs, self.ends[0])
        try:
            message = self.carry(batch, message)
        except Exception:
            for runtime, ends in zip(self.runtimes, self.ends, strict=True):
                runtime.drop(batch, ends)
            raise
        return message.metrics

    def carry(self, batch: MicroBatch, message, until=None):
        """`message` on through the stages until `batch` is done, or until a message `until(message)`
        holds back (a test's backward left pending, as a swarm's may be); the last message."""
        while message.kind is not Kind.DONE and not (until is not None and until(message)):
            stage, ends = self.runtimes[message.to_stage], self.ends[message.to_stage]
            received = wire.decode(message.payload)  # our own bytes: the default limits
            if message.kind is Kind.FORWARD:
                following = stage.forward(batch, received, ends)
            else:
                following = stage.backward(batch, received, message.metrics, ends)
            message.delivered()
            message = following
        return message

    def run_many(self, items, following=()) -> list[dict[str, float]]:
        """(micro-batch, inputs) pairs one after another: the swarm's order, without the overlap
        (`following`, the next step's micro-batches a swarm starts early, wait for their own call).
        An asynchronous schedule's look-ahead runs training micro-batches at the predicted weights."""
        items = list(items)
        with ExitStack() as ahead:
            if items and items[0][0].mode is Mode.TRAIN:
                for runtime in self.runtimes:
                    if runtime.delay is not None:
                        ahead.enter_context(runtime.delay.ahead(runtime.module))
            return [self._run(batch, inputs) for batch, inputs in items]

    # ---- the synchronous step (swarm.engine.step), its rounds on the runtimes -----------------

    def step(self) -> float:
        for runtime in self.runtimes:
            runtime.accumulate_held()  # the exact sum a swarm's replicas get too (swarm.engine.exactsum)
        delayed = [r for r in self.runtimes if r.delay is not None]  # train.schedule async (swarm.engine.delay)
        # a list, not a generator: every stage swaps, whatever the first one says
        if delayed and not any([r.delay.swap(r.module) for r in delayed]):  # the first step: nothing yet
            return self.runtimes[0].optimizer.param_groups[0]["lr"]
        lr = synchronous_step(self, self.tied, self.grad_clip)
        for runtime in delayed:
            runtime.delay.applied(runtime.module)
        return lr

    def gather(self, wanted: dict[int, list[str]]) -> Grads:
        return {stage: self.runtimes[stage].gradients(names) for stage, names in wanted.items()}

    def replicated(self, stage: int) -> bool:
        return False

    def set_gradients(self, grads: Grads, norm: bool) -> float:
        for stage, named in grads.items():
            self.runtimes[stage].set_gradients(named)
        return sum(r.grad_sq_norm() for r in self.runtimes) if norm else 0.0

    def apply(self, scale: float) -> float:
        lrs = []
        for runtime in self.runtimes:
            if scale:
                runtime.scale_grads(scale)
            lrs.append(runtime.apply_step())
        return lrs[0]

    # ---- accounting and checkpoints -----------------------------------------------------------

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent per boundary, direction and mode, e.g. 'boundary0.forward.train'."""
        totals: Counter = Counter()
        for ends in self.ends:
            for end in ends:
                if end is None:
                    continue
                for (mode, direction), n in end.bytes.items():
                    totals[f"boundary{end.boundary}.{direction}.{mode}"] += n
        return dict(sorted(totals.items()))

    def state_bytes(self) -> int:
        return sum(ends.state_bytes() for ends in self.ends)

    def save_checkpoint(self, directory, step: int) -> None:
        for runtime, ends in zip(self.runtimes, self.ends, strict=True):
            save_stage(runtime, ends, stage_file(directory, runtime.index), step)

    def load_checkpoint(self, directory) -> int:
        """Loads every stage's file from `directory`; returns the step they were saved at."""
        checkpoint_codecs(directory, adaptive=False)  # refuses an adaptive swarm's: one process has fixed codecs
        steps = {
            load_stage(runtime, ends, stage_file(directory, runtime.index))
            for runtime, ends in zip(self.runtimes, self.ends, strict=True)
        }
        if len(steps) != 1:
            raise ValueError(f"checkpoint {directory} mixes stages saved at steps {sorted(steps)}")
        return steps.pop()

    def drains(self, step: int) -> bool:
        return False

    def snapshot(self, step: int, position: dict) -> None:
        """One process keeps no copies: it is the whole run (its checkpoints are files)."""

    def resumed(self) -> dict | None:
        return None

    def step_notes(self) -> dict:
        return {}

    def summary_notes(self) -> dict:
        return {}


def build_local_pipeline(
    cfg: ExperimentConfig, total_steps: int, capacity: int | None = None
) -> tuple[LocalPipeline, StagedModel]:
    staged = build_staged_model(cfg)
    stages = range(cfg.model.num_stages)
    runtimes = [build_runtime(cfg, staged, i, total_steps) for i in stages]
    ends = [link_ends(cfg, i, capacity) for i in stages]
    return LocalPipeline(runtimes, ends, staged.tied, cfg.optimizer.grad_clip), staged
