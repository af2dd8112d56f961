"""A study's rows as the findings see them (swarm.study.findings), and lookups by what they run
(codec specs, warmup, model), not by file name, so any study shaped like the paper's tables can be
checked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Row:
    """One run as the checks see it (built by swarm.study.runs.as_row from a results file or a pending config)."""

    name: str
    model: str  # resnet18 | gpt2 | ...
    forward: str
    backward: str
    warmup: float = 0.0  # epochs uncompressed first
    finished: bool = False
    acc_off: float | None = None  # best test accuracy (%), compression off at inference
    acc_on: float | None = None  # ... and on
    loss_off: float | None = None  # final eval loss (language models)
    loss_on: float | None = None
    paper: dict[str, float] = field(default_factory=dict)
    # per-seed values of acc_off, acc_on, loss_off, loss_on (those fields are their means); a row
    # without them is one seed of the field's value
    seeds: dict[str, list[float]] = field(default_factory=dict)

    def values(self, key: str) -> list[float]:
        return self.seeds.get(key) or [getattr(self, key)]


_TOPK = re.compile(r"^topk:([0-9.]+)(?:/[a-z0-9]+)?(?:\+([a-z0-9]+)(?:/[a-z0-9]+)?)?$")
_QUANT = re.compile(r"^quant:(\d+)(?:/[a-z]+)*$")


def topk_spec(spec: str) -> tuple[float, str | None] | None:
    m = _TOPK.match(spec)
    return (float(m.group(1)), m.group(2)) if m else None


def quant_bits(spec: str) -> int | None:
    m = _QUANT.match(spec)
    return int(m.group(1)) if m else None


class Study:
    """Lookups over a study's rows."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def find(self, model: str, pred) -> Row | None:
        return next((r for r in self.rows if r.model == model and pred(r)), None)

    def baseline(self, model: str) -> Row | None:
        return self.find(model, lambda r: r.forward == "none" and r.backward == "none")

    def quant(self, fw: int, bw: int) -> Row | None:
        return self.find("resnet18", lambda r: (quant_bits(r.forward), quant_bits(r.backward)) == (fw, bw))

    def topk(
        self,
        ratio: float,
        model: str = "resnet18",
        feedback: str | None = None,
        warmup: bool = False,
        backward: str | None = None,
    ) -> Row | None:
        def pred(r: Row) -> bool:
            fw = topk_spec(r.forward)
            if fw is None or fw[0] != ratio or fw[1] != feedback or bool(r.warmup) != warmup:
                return False
            if backward is not None:
                return r.backward == backward
            bw = topk_spec(r.backward)
            return bw is not None and bw[0] == ratio and (feedback == "aqsgd" or bw[1] == feedback)

        return self.find(model, pred)
