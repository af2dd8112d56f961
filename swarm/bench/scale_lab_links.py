"""How the stage peers' links ran in a lab run, from their timelines (`--trace`): each peer's time
sending (the union of its payload sends to other stages) and the payload rate while it sent.

A paced peer sends a payload at PAYLOAD_SHARE of its link (swarm.transport.hivemind.flow.pacing);
a send that takes longer (the pacer or the p2p daemon late for a core on a busy machine, TCP
backing off) shows as a sending rate below that, and a link idle between sends as a busy fraction
below one: what the model's links (always at the paced rate while they have work) do not have.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkUse:
    busy: float  # fraction of the window the peer was sending a payload to another stage
    payload_bits_per_s: float  # while sending


def union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the spans (start, end), overlaps counted once."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def steady_window(trainer: dict, warmup: int) -> tuple[float, float]:
    """Wall seconds from the end of the trainer's `warmup`-th step to the end of its last (its
    `steps` track: `micro-batches N` then `step N` spans)."""
    steps = sorted(
        (e["ts"] + e["dur"]) / 1e6
        for e in trainer["traceEvents"]
        if e.get("ph") == "X" and e["name"].startswith("step ")
    )
    if len(steps) <= warmup:
        raise ValueError(f"the trainer's timeline has {len(steps)} steps; more than {warmup} are needed")
    return steps[warmup - 1] if warmup else steps[0], steps[-1]


def link_use(trace: dict, window: tuple[float, float], stage: int, payload_bytes: dict[str, float]) -> LinkUse:
    """One stage peer's sending in `window`: `payload_bytes` per send, forward and backward (a
    micro-batch's payload over the boundary after and before `stage`)."""
    tracks = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    start, end = window
    spans, sent = [], 0.0
    for e in trace["traceEvents"]:
        track = tracks.get(e.get("tid"), "")
        if e.get("ph") != "X" or not track.startswith("send to stage"):
            continue
        a, b = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        if b <= start or a >= end:
            continue
        spans.append((max(a, start), min(b, end)))
        to = int(track.removeprefix("send to stage").split()[0].split(".")[0])
        sent += (
            payload_bytes["forward" if to > stage else "backward"] * (min(b, end) - max(a, start)) / max(b - a, 1e-9)
        )
    busy = union_s(spans)
    return LinkUse(busy / (end - start), 8 * sent / busy if busy else 0.0)
