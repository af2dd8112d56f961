"""`train.delay_correction`'s spec: how an asynchronous schedule (swarm.engine.delay) makes up for
gradients a step old."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DelayCorrection:
    kind: str = "none"  # none | dc | lookahead
    strength: float = 0.0  # dc's LAMBDA

    @classmethod
    def parse(cls, spec: str) -> DelayCorrection:
        """`none`, `lookahead` or `dc:LAMBDA` (LAMBDA a positive number); ValueError in one line otherwise."""
        if spec in ("none", "lookahead"):
            return cls(spec)
        kind, _, value = spec.partition(":")
        if kind == "dc":
            try:
                strength = float(value)
            except ValueError:
                strength = math.nan
            if math.isfinite(strength) and strength > 0:
                return cls("dc", strength)
        raise ValueError(
            f"delay correction {spec!r}: expected none, lookahead or dc:LAMBDA with LAMBDA > 0 (e.g. dc:0.1)"
        )
