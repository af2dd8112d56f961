"""What a benchmark point ran and achieved: the pieces both bench throughput's and bench
time-to-target's rows are made of, and a row's JSON: one flat object per point, as the files under
docs/bench/ hold them (so a row keeps its keys however its fields are grouped in pieces)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import get_type_hints


@dataclass
class Point:
    """What was run: the codec each way, the rate and one-way delay of every process's access link
    and how the links were shaped ("netns" or "inprocess", swarm.lab.launch)."""

    codec: str  # the forward codec, or the benchmark's name of a baseline (torch:gloo)
    backward: str
    bandwidth_mbit: float
    shaping: str = "netns"
    delay_ms: float = 0.0  # one way, on every process's link


@dataclass
class Achieved:
    """The samples/s a point achieved against what bounded it (swarm.bench.throughput_figures)."""

    samples_per_s: float
    link_bound: float
    compute_bound: float
    fraction_of_bound: float  # of min(link bound, compute bound)
    binding: str  # what the bound is: "link <process> <direction>", "compute" or "cores (N shared)"


def flat_json(row) -> dict:
    """`row` as one flat object: each piece's fields (a dataclass field's) in its place."""
    flat = {}
    for f in fields(row):
        value = getattr(row, f.name)
        flat.update(asdict(value) if is_dataclass(value) else {f.name: value})
    return flat


def from_flat_json(cls, flat: dict):
    """A `cls` from its flat object (`flat_json`'s); a key it lacks takes the field's default, a key
    `cls` does not know is left out (a newer file's)."""
    kinds = get_type_hints(cls)
    found = {}
    for f in fields(cls):
        if isinstance(kinds[f.name], type) and is_dataclass(kinds[f.name]):
            found[f.name] = from_flat_json(kinds[f.name], flat)
        elif f.name in flat:
            found[f.name] = flat[f.name]
    return cls(**found)
