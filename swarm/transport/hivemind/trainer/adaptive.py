"""The trainer's side of `compression.adaptive`: per boundary, the codecs the next steps use.

Every `every` optimizer steps the trainer reads the stage peers' statuses and, per boundary,
measures since the last decision:
- the bandwidth per direction: activation bytes that arrived at the downstream stage, and
  gradient bytes that arrived back at the upstream stage, over the seconds they were arriving
  (transfers that overlap count once; swarm.transport.hivemind.flow.meter), i.e. what the link delivered while
  busy, with whatever else shared it. A direction with no timed bytes yet (replies of one chunk
  are not timed) is taken to run at the other one's rate. Bytes and seconds are summed over
  windows with weights halving every window, so a window of long transfers outweighs one of
  small payloads that a link's burst allowance delivered at once (which would otherwise look
  like a fast link and make the choice flap back to milder settings);
- the target: the compute seconds per training sample of the slower neighbouring stage (or the
  config's `target_ms`);
- the elements per sample (uncompressed bytes / 4), for the ladder's bytes model.
`swarm.compression.adaptive.AdaptiveCompression` then picks the mildest setting of the ladder whose
link time fits (with hysteresis on the way back). Changes travel in the step's apply round, when
no micro-batch is in flight, so both ends of a link switch between the same two steps; the
link's codec state starts afresh.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass

from protocols import stage_pb2 as pb
from swarm.compression.adaptive import (
    AdaptiveCompression,
    Decision,
    neighbour_targets,
    quant_candidates,
    topk_candidates,
)
from swarm.config import ExperimentConfig

DECAY = 0.5  # weight of a window's measurement once the next window is in


def ladder_codecs(spec: str) -> tuple[str, str]:
    """A ladder setting as (forward, backward) specs: TopK gradients reuse the forward indices."""
    if spec.startswith("topk:"):
        return spec, "topk:reuse"
    return spec, spec


@dataclass
class _Totals:
    """Cumulative counters read from the statuses (the deltas between two reads are one window)."""

    busy_bytes: dict[int, float]  # forward: activations timed arriving, per boundary
    busy_s: dict[int, float]
    back_bytes: dict[int, float]  # backward: gradient replies timed arriving
    back_s: dict[int, float]
    raw: dict[int, float]  # uncompressed forward training bytes per boundary
    compute_s: dict[int, float]
    samples: dict[int, float]

    @classmethod
    def read(cls, statuses: list[pb.StageStatus]) -> _Totals:
        t = cls(*(defaultdict(float) for _ in range(len(_FIELDS))))
        for status in statuses:
            t.compute_s[status.stage] += status.compute_s
            t.samples[status.stage] += status.samples
            for link in status.links:
                if link.upstream:  # this peer sends activations on it, gradients come back
                    t.raw[link.boundary] += link.raw.get("forward.train", 0)
                    t.back_bytes[link.boundary] += link.busy_bytes
                    t.back_s[link.boundary] += link.busy_s
                else:
                    t.busy_bytes[link.boundary] += link.busy_bytes
                    t.busy_s[link.boundary] += link.busy_s
        return t

    def minus(self, other: _Totals | None) -> _Totals:
        if other is None:
            return self
        # a peer that left takes its counters along: no window is negative
        return _Totals(
            *(
                {k: max(v - getattr(other, name).get(k, 0.0), 0.0) for k, v in getattr(self, name).items()}
                for name in _FIELDS
            )
        )


_FIELDS = ("busy_bytes", "busy_s", "back_bytes", "back_s", "raw", "compute_s", "samples")


class AdaptiveCodecs:
    def __init__(self, cfg: ExperimentConfig) -> None:
        settings = cfg.compression.adaptive
        if settings is None:
            raise ValueError("the config has no compression.adaptive section")
        self.settings = settings
        # an asynchronous run's changes come with the apply round of the step before the decision's
        # (trainer.closing `switch`): the first decision comes after its second step
        self.first = 2 if cfg.train.schedule == "async" else 1
        self.boundaries = list(range(cfg.model.num_stages - 1))
        self.codecs = {b: (cfg.compression.link(b).forward, cfg.compression.link(b).backward) for b in self.boundaries}
        self.controller: AdaptiveCompression | None = None
        self.last: dict[int, Decision] = {}
        self.ran = self.current()  # the codecs the latest step ran with
        self.history: list[dict] = []  # every change: decided after `step`, in force `from_step` on
        self._previous: _Totals | None = None
        self._sums: dict[str, dict[int, float]] = {
            name: defaultdict(float) for name in ("busy_bytes", "busy_s", "back_bytes", "back_s")
        }  # decayed (see module doc)

    def due(self, step: int) -> bool:
        """`step` counts finished optimizer steps, this one included."""
        return step >= self.first and step % self.settings.every == 0

    def summary(self) -> dict:
        """The summary row's account: every change, the codecs in force, the latest decisions."""
        decisions = {str(b): d.describe() for b, d in sorted(self.last.items())}
        return {"changes": self.history, "codecs": self.ran, "decisions": decisions}

    def step_done(self) -> None:
        """A step ran (call before deciding on it): its codecs are the ones in force."""
        self.ran = self.current()

    def observe(self, statuses: list[pb.StageStatus], step: int) -> dict[int, tuple[str, str]]:
        """Decides, after `step`, from what happened since the last call; returns the boundaries
        whose codecs change from the next step on."""
        totals = _Totals.read(statuses)
        window = totals.minus(self._previous)
        self._previous = totals
        if any(window.samples.get(s, 0) <= 0 for s in range(len(self.boundaries) + 1)):
            return {}  # no training went through every stage in this window
        per_sample = [window.compute_s[s] / window.samples[s] for s in range(len(self.boundaries) + 1)]
        targets = (
            neighbour_targets(per_sample)
            if self.settings.target_ms is None
            else dict.fromkeys(self.boundaries, self.settings.target_ms / 1000)
        )
        for name, sums in self._sums.items():
            for b in self.boundaries:
                sums[b] = DECAY * sums[b] + getattr(window, name).get(b, 0.0)
        bandwidth = {b: self.bandwidth(b) for b in self.boundaries}
        if self.controller is None:
            self.controller = self._controller(window)
        decisions = self.controller.decide(bandwidth, targets)
        changes = {}
        for b, decision in decisions.items():
            self.last[b] = decision
            codecs = ladder_codecs(decision.spec)
            if codecs != self.codecs[b]:
                changes[b] = codecs
                self.codecs[b] = codecs
                self.history.append(
                    {
                        "step": step,
                        "from_step": step + 1,
                        "boundary": b,
                        "forward": codecs[0],
                        "backward": codecs[1],
                        "why": decision.describe(),
                    }
                )
        return changes

    def bandwidth(self, boundary: int) -> tuple[float, float]:
        """(forward, backward) bits/s measured so far; inf where nothing was timed."""

        def rate(nbytes: str, seconds: str) -> float:
            busy = self._sums[seconds][boundary]
            return self._sums[nbytes][boundary] * 8 / busy if busy > 0 else math.inf

        forward, backward = rate("busy_bytes", "busy_s"), rate("back_bytes", "back_s")
        if math.isinf(backward):
            backward = forward  # not timed (one-chunk replies): assume a symmetric link
        if math.isinf(forward):
            forward = backward
        return forward, backward

    def _controller(self, window: _Totals) -> AdaptiveCompression:
        candidates = {}
        for b in self.boundaries:
            elements = max(1, round(window.raw.get(b, 0) / 4 / window.samples[b]))
            candidates[b] = topk_candidates(elements) if self.settings.ladder == "topk" else quant_candidates(elements)
        controller = AdaptiveCompression(candidates, hysteresis=self.settings.hysteresis)
        for (
            b,
            options,
        ) in candidates.items():  # start from the codecs in force (a resumed run's too), so the hysteresis holds
            in_force = [i for i, option in enumerate(options) if ladder_codecs(option.spec) == tuple(self.codecs[b])]
            if in_force:
                controller.current[b] = in_force[0]
        return controller

    def saved(self) -> str:
        """The codecs in force and the changes so far, as a checkpoint keeps them (JSON)."""
        return json.dumps(
            {"codecs": {str(b): list(c) for b, c in self.codecs.items()}, "history": self.history}, indent=1
        )

    def restore_saved(self, text: str) -> None:
        """`restore` from what `saved` wrote."""
        saved = json.loads(text)
        self.restore({"codecs": {int(b): tuple(c) for b, c in saved["codecs"].items()}, "history": saved["history"]})

    def restore(self, saved: dict) -> None:
        """Resumes from `swarm.engine.checkpoint.checkpoint_codecs`: its codecs are in force, and the next decision moves
        from them as from any other (with the hysteresis), on fresh measurements (a resumed
        swarm's links may not be the saved run's)."""
        unknown = sorted(set(saved["codecs"]) - set(self.boundaries))
        if unknown:
            raise ValueError(
                f"the checkpoint has codecs for boundaries {unknown}; this run has boundaries 0..{len(self.boundaries) - 1}"
            )
        self.codecs.update(saved["codecs"])
        self.history = list(saved["history"])
        self.ran = self.current()
        self.controller, self.last, self._previous = None, {}, None
        for sums in self._sums.values():
            sums.clear()

    def current(self) -> dict[str, str]:
        """Per boundary, 'forward / backward' in force from the next step on (for the results rows)."""
        return {str(b): f"{fw} / {bw}" for b, (fw, bw) in self.codecs.items()}

    def report(self) -> str:
        return self.controller.report() if self.controller is not None else "adaptive compression: no decision yet"
