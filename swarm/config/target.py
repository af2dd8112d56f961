"""A training target, `METRIC=VALUE`: the evaluation a run stops at (train.target).

Loss and perplexity are better lower, anything else (accuracy) higher; `METRIC<=VALUE` and
`METRIC>=VALUE` say the direction outright.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_FORM = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(<=|>=|=)\s*([^\s]+)\s*$")
# what an evaluation can report (swarm.models.base.summarize): a misspelt metric is refused with
# the config, before any step; whether this model and data report it is known at the first evaluation
METRICS = ("loss", "accuracy", "perplexity")


@dataclass(frozen=True)
class Target:
    metric: str
    value: float
    lower_is_better: bool

    @classmethod
    def parse(cls, text: str) -> Target:
        """ValueError (one line) unless `text` is METRIC=VALUE, METRIC<=VALUE or METRIC>=VALUE."""
        match = _FORM.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"a target is METRIC=VALUE (e.g. loss=2.0 or accuracy=0.9), got {text!r}")
        metric, sign, number = match.groups()
        if metric not in METRICS:
            raise ValueError(f"target {text!r}: the metric is one of {', '.join(METRICS)}, not {metric!r}")
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"target {text!r}: {number!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"target {text!r}: the value must be finite")
        lower = sign == "<=" or (sign == "=" and (metric.endswith("loss") or metric == "perplexity"))
        return cls(metric, value, lower)

    def reached(self, metrics: dict[str, float]) -> bool:
        """Whether an evaluation's metrics reach the target (a missing or NaN metric never does)."""
        got = metrics.get(self.metric)
        if got is None or not math.isfinite(got):
            return False
        return got <= self.value if self.lower_is_better else got >= self.value

    def require_reported(self, metrics: dict[str, float]) -> None:
        """ValueError (one line) when an evaluation does not report the target's metric at all:
        the run would otherwise go to its last step without ever being able to stop early."""
        if not metrics:
            raise ValueError(
                f"train.target {self}: the evaluations report no metrics (no samples counted, or no loss nor accuracy)"
            )
        if self.metric not in metrics:
            reported = ", ".join(sorted(metrics))
            raise ValueError(f"train.target {self}: the evaluations report {reported}, not {self.metric}")

    def __str__(self) -> str:
        return f"{self.metric}{'<=' if self.lower_is_better else '>='}{self.value:g}"
