"""Error-feedback cases shared by the feedback test modules (not a test module itself)."""

from __future__ import annotations

import torch

from protocols import wire
from swarm.compression import parse

MIRRORED = [
    "topk:0.1+ef21",
    "quant:4+ef21",
    "fp16+ef21",
    "topk:0.2/q8+ef21",
    "topk:0.1+ef21/sample",
    "quant:3+ef21/sample",
    "topk:0.2+aqsgd/fp32",
    "topk:0.2+aqsgd/fp16",
    "topk:0.2+aqsgd",  # default store: q6
    "quant:4+aqsgd/q4",
    "topk:0.3/q6+aqsgd/q8",
    "quant:2/tensor+aqsgd/bf16",
    "lowrank:2+ef21",
    "lowrank:3/q8+ef21/sample",
    "lowrank:2+aqsgd/fp16",
    "lowrank:2/warm+ef21",  # the sender's warm start beside the mirrored buffers
]
PER_SAMPLE = [s for s in MIRRORED if "aqsgd" in s or "/sample" in s]
GLOBAL = [s for s in MIRRORED if s not in PER_SAMPLE]

DATASET = 8
SAMPLE_SHAPE = (3, 10)


class Link:
    """Both ends of one link direction, with helpers to look at their state."""

    def __init__(self, spec: str, **kw) -> None:
        self.spec = parse(spec)
        self.sender = self.spec.sender(**kw.get("sender", {}))
        self.receiver = self.spec.receiver(**kw.get("receiver", {}))
        self.per_sample = self.spec.per_sample

    def keys(self, ids):
        return list(ids) if self.per_sample else None

    def state(self, end, shape, ids):
        table = (self.sender if end == "sender" else self.receiver).table
        return table.load(tuple(shape), self.keys(ids), "cpu")

    def assert_mirrored(self, shape, ids):
        s, sv = self.state("sender", shape, ids)
        r, rv = self.state("receiver", shape, ids)
        assert sv == rv
        assert torch.equal(s, r), float((s - r).abs().max())

    def step(self, x, ids, warmup=False, commit=True):
        out = self.sender.send(x, sample_ids=ids, warmup=warmup)
        inc = self.receiver.receive(wire.decode(out.payload), sample_ids=ids)
        if commit:
            out.commit()
            inc.commit()
        return out, inc


def dataset(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    base = torch.randn((DATASET, *SAMPLE_SHAPE), generator=g)
    drift = torch.randn((DATASET, *SAMPLE_SHAPE), generator=g)
    return base, drift


def store_error_bound(spec, x):
    """Largest error that storing x in the spec's state format may add, per element."""
    parsed = parse(spec)
    if not parsed.per_sample or parsed.store == "fp32":
        return torch.zeros(())
    if parsed.store in ("fp16", "bf16"):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[parsed.store]
        return torch.finfo(dtype).eps * x.abs().max()
    bits = int(parsed.store[1:])
    rows = x.reshape(x.shape[0], -1).float()
    span = (rows.max(dim=1).values - rows.min(dim=1).values).max()
    return span / ((1 << bits) - 1) / 2 + 1e-5 * x.abs().max()
