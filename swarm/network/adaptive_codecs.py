"""The trainer's side of `compression.adaptive`: per boundary, the codecs the next steps use.

Every `every` optimizer steps the trainer reads the stage peers' statuses and, per boundary,
measures since the last decision:
- the bandwidth: activation bytes that arrived at the downstream stage over the seconds they were
  arriving (transfers that overlap count once), i.e. what the link delivered while busy, with
  whatever else shared it. Bytes and seconds are summed over windows with weights halving every
  window, so a window of long transfers outweighs one of small payloads that a link's burst
  allowance delivered at once (which would otherwise look like a fast link and make the choice
  flap back to milder settings);
- the target: the compute seconds per training sample of the slower neighbouring stage (or the
  config's `target_ms`);
- the elements per sample (uncompressed bytes / 4), for the ladder's bytes model.
`swarm.netlab.adaptive.AdaptiveCompression` then picks the mildest setting of the ladder whose
link time fits (with hysteresis on the way back). Changes travel in the step's apply round, when
no micro-batch is in flight, so both ends of a link switch between the same two steps; the
link's codec state starts afresh.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from protocols import stage_pb2 as pb
from swarm.config import ExperimentConfig
from swarm.netlab.adaptive import AdaptiveCompression, Decision, neighbour_targets, quant_candidates, topk_candidates

DECAY = 0.5  # weight of a window's measurement once the next window is in


def ladder_codecs(spec: str) -> tuple[str, str]:
    """A ladder setting as (forward, backward) specs: TopK gradients reuse the forward indices."""
    if spec.startswith("topk:"):
        return spec, "topk:reuse"
    return spec, spec


@dataclass
class _Totals:
    """Cumulative counters read from the statuses (the deltas between two reads are one window)."""

    busy_bytes: dict[int, float]
    busy_s: dict[int, float]
    raw: dict[int, float]  # uncompressed forward training bytes per boundary
    compute_s: dict[int, float]
    samples: dict[int, float]

    @classmethod
    def read(cls, statuses: list[pb.StageStatus]) -> _Totals:
        t = cls(*(defaultdict(float) for _ in range(5)))
        for status in statuses:
            t.compute_s[status.stage] += status.compute_s
            t.samples[status.stage] += status.samples
            for link in status.links:
                if link.upstream:
                    t.raw[link.boundary] += link.raw.get("forward.train", 0)
                else:
                    t.busy_bytes[link.boundary] += link.busy_bytes
                    t.busy_s[link.boundary] += link.busy_s
        return t

    def minus(self, other: _Totals | None) -> _Totals:
        if other is None:
            return self
        return _Totals(*({k: v - getattr(other, name).get(k, 0.0) for k, v in getattr(self, name).items()} for name in ("busy_bytes", "busy_s", "raw", "compute_s", "samples")))


class AdaptiveCodecs:
    def __init__(self, cfg: ExperimentConfig) -> None:
        settings = cfg.compression.adaptive
        if settings is None:
            raise ValueError("the config has no compression.adaptive section")
        self.settings = settings
        self.boundaries = list(range(cfg.model.num_stages - 1))
        self.codecs = {b: (cfg.compression.link(b).forward, cfg.compression.link(b).backward) for b in self.boundaries}
        self.controller: AdaptiveCompression | None = None
        self.last: dict[int, Decision] = {}
        self.history: list[dict] = []  # every change: step, boundary, codecs, why
        self._previous: _Totals | None = None
        self._bytes: dict[int, float] = defaultdict(float)  # decayed sums (see module doc)
        self._busy: dict[int, float] = defaultdict(float)

    def due(self, step: int) -> bool:
        """`step` counts finished optimizer steps, this one included."""
        return step % self.settings.every == 0

    def observe(self, statuses: list[pb.StageStatus], step: int) -> dict[int, tuple[str, str]]:
        """Decides from what happened since the last call; returns the boundaries whose codecs change."""
        totals = _Totals.read(statuses)
        window = totals.minus(self._previous)
        self._previous = totals
        stages = sorted(window.samples)
        if not stages or any(window.samples.get(s, 0) <= 0 for s in range(len(self.boundaries) + 1)):
            return {}  # no training went through every stage in this window
        per_sample = [window.compute_s[s] / window.samples[s] for s in range(len(self.boundaries) + 1)]
        targets = neighbour_targets(per_sample) if self.settings.target_ms is None else dict.fromkeys(self.boundaries, self.settings.target_ms / 1000)
        for b in self.boundaries:
            self._bytes[b] = DECAY * self._bytes[b] + window.busy_bytes.get(b, 0.0)
            self._busy[b] = DECAY * self._busy[b] + window.busy_s.get(b, 0.0)
        bandwidth = {b: self._bytes[b] * 8 / self._busy[b] if self._busy[b] > 0 else math.inf for b in self.boundaries}
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
                self.history.append({"step": step, "boundary": b, "forward": codecs[0], "backward": codecs[1], "why": decision.describe()})
        return changes

    def _controller(self, window: _Totals) -> AdaptiveCompression:
        candidates = {}
        for b in self.boundaries:
            elements = max(1, round(window.raw.get(b, 0) / 4 / window.samples[b]))
            candidates[b] = topk_candidates(elements) if self.settings.ladder == "topk" else quant_candidates(elements)
        return AdaptiveCompression(candidates, hysteresis=self.settings.hysteresis)

    def current(self) -> dict[str, str]:
        """Per boundary, 'forward / backward' (for the results rows)."""
        return {str(b): f"{fw} / {bw}" for b, (fw, bw) in self.codecs.items()}
