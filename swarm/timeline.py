"""Several peers' timelines (swarm.tracing) as one: clocks aligned, what each peer spent its time on,
and a picture.

Clocks. Peers on other machines have clocks that differ. Every micro-batch exchange was timed by
both sides (the caller: its request leaving, the reply back; the callee: the request arriving, the
reply gone), which gives the two clocks' offset as NTP estimates it, ((t1 - t0) + (t2 - t3)) / 2,
most precisely from the exchange with the least time on the wire. Offsets chain from the trainer
along the pipeline; a peer with no exchange in the traces keeps its own clock (on one machine, the
same as the others').

    python -m swarm timeline stage*.json trainer.json --out run.json --plot run.png
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from pathlib import Path

COLORS = {"compute": "#4878d0", "send": "#ee854a", "receive": "#6acc64", "await": "#d5bb67", "wait": "#d65f5f"}
COLORS["step"] = COLORS["steps"] = "#956cb4"


def load(path: str | Path) -> dict:
    trace = json.loads(Path(path).read_text())
    if not isinstance(trace, dict) or "traceEvents" not in trace or "otherData" not in trace:
        raise ValueError(f"{path}: not a timeline a peer wrote (python -m peers.* --trace)")
    return trace


def offsets(traces: list[dict]) -> dict[str, float]:
    """Seconds to subtract from each peer's clock (by peer id) to read the root's: the trainer's,
    else the first trace's."""
    exchanges = {t["otherData"]["peer_id"]: t["otherData"].get("exchanges", []) for t in traces}
    callers = {
        (peer, e["peer"], e["key"]): e for peer, done in exchanges.items() for e in done if e["role"] == "caller"
    }
    best: dict[tuple[str, str], tuple[float, float]] = {}  # (caller, callee) -> (wire time, callee - caller)
    for callee, done in exchanges.items():
        for e in done:
            caller = callers.get((e["peer"], callee, e["key"])) if e["role"] == "callee" else None
            if caller is None:
                continue
            wire = (caller["t1"] - caller["t0"]) - (e["t1"] - e["t0"])
            theta = ((e["t0"] - caller["t0"]) + (e["t1"] - caller["t1"])) / 2
            key = (e["peer"], callee)
            if key not in best or wire < best[key][0]:
                best[key] = (wire, theta)
    links: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for (caller, callee), (_, theta) in best.items():
        links[caller].append((callee, theta))
        links[callee].append((caller, -theta))
    named = {t["otherData"]["process"]: t["otherData"]["peer_id"] for t in traces}
    root = named.get("trainer") or traces[0]["otherData"]["peer_id"]
    found = {peer: 0.0 for peer in exchanges}
    seen, queue = {root}, deque([root])
    while queue:
        peer = queue.popleft()
        for other, theta in links[peer]:
            if other not in seen and other in found:
                seen.add(other)
                found[other] = found[peer] + theta
                queue.append(other)
    return found


def merge(traces: list[dict]) -> dict:
    """One Chrome trace of several peers' timelines, clocks aligned; processes numbered in order
    (the trainer first, then by name)."""
    shift = offsets(traces)
    ordered = sorted(traces, key=lambda t: (t["otherData"]["process"] != "trainer", t["otherData"]["process"]))
    events = []
    for pid, trace in enumerate(ordered, start=1):
        delta_us = shift[trace["otherData"]["peer_id"]] * 1e6
        for event in trace["traceEvents"]:
            moved = {**event, "pid": pid}
            if "ts" in moved:
                moved["ts"] = event["ts"] - delta_us
            events.append(moved)
    processes = [t["otherData"]["process"] for t in ordered]
    aligned = {t["otherData"]["process"]: round(1000 * shift[t["otherData"]["peer_id"]], 3) for t in ordered}
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"processes": processes, "offsets_ms": aligned},
    }


def _spans(trace: dict) -> dict[tuple[int, str], list[tuple[float, float, str]]]:
    """(pid, track) -> [(start s, end s, name)] of a merged trace."""
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"
    }
    spans: dict[tuple[int, str], list] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            start = e["ts"] / 1e6
            spans[(e["pid"], names.get((e["pid"], e.get("tid")), "?"))].append(
                (start, start + e["dur"] / 1e6, e["name"])
            )
    return spans


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] that the intervals cover (overlaps once)."""
    total, end = 0.0, lo
    for start, stop in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if stop > max(start, end):
            total += stop - max(start, end)
            end = stop
    return total


def _steps(trace: dict) -> list[tuple[float, float]]:
    """The trainer's training steps, [their micro-batches' start, their rounds' end], in order."""
    began, ended = {}, {}
    for (_, track), spans in _spans(trace).items():
        for start, end, name in spans if track == "steps" else ():
            kind, _, step = name.rpartition(" ")
            if kind == "micro-batches":
                began[step] = start
            elif kind == "step":
                ended[step] = end
    return sorted((began[k], ended[k]) for k in began if k in ended)


def steady_window(trace: dict) -> tuple[float, float]:
    """The trainer's training steps after the first (its warm-up), else the whole trace."""
    steps = _steps(trace)
    if len(steps) > 1:
        return steps[1][0], steps[-1][1]
    starts = [e["ts"] / 1e6 for e in trace["traceEvents"] if e.get("ph") == "X"]
    ends = [(e["ts"] + e["dur"]) / 1e6 for e in trace["traceEvents"] if e.get("ph") == "X"]
    return (min(starts), max(ends)) if starts else (0.0, 0.0)


def step_window(trace: dict, index: int = 1) -> tuple[float, float]:
    """The trainer's `index`-th training step (0: the first), else the steady window."""
    steps = _steps(trace)
    return steps[min(index, len(steps) - 1)] if steps else steady_window(trace)


def where_time_goes(trace: dict, window: tuple[float, float] | None = None) -> list[str]:
    """One line per peer: the share of `window` (default: the steady steps) it spent computing,
    sending, receiving, awaiting replies and waiting (a category's tracks together, overlaps once)."""
    lo, hi = window or steady_window(trace)
    if hi <= lo:  # a run that failed before its first step: shares of nothing would read as idle peers
        return ["no time to share out: the timeline has no span (the run ended before its first step?)"]
    processes = trace["otherData"]["processes"]
    by_category: dict[tuple[int, str], list] = defaultdict(list)
    for (pid, track), spans in _spans(trace).items():
        by_category[(pid, track.split(" ", 1)[0])].extend((s, e) for s, e, _ in spans)
    lines = [f"over {hi - lo:.2f} s (the steady steps): share of the time each peer spent"]
    for pid, process in enumerate(processes, start=1):
        shares = {
            category: _covered(by_category[(pid, category)], lo, hi) / (hi - lo) if hi > lo else 0.0
            for category in ("compute", "send", "receive", "await", "wait")
        }
        lines.append(f"  {process:<14} " + ", ".join(f"{c} {100 * v:.0f}%" for c, v in shares.items()))
    return lines


def _spread(values: list[float]) -> str:
    return f"{sum(values) / len(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def step_marks(trace: dict) -> list[str]:
    """When each peer's part of a step happens: over the trainer's steady steps (each from its
    micro-batches' start to the next step's), in seconds from the step's start (mean, range): its
    first payload received and sent, its last payload's end, how long it was sending and at what
    rate, and its compute; the trainer's replies back, its own step work and the gap to the next
    step. Compare with what a perfect network gives the same schedule (swarm.bench.fluid `marks`)."""
    processes = trace["otherData"]["processes"]
    bounds = [start for start, _ in _steps(trace)]
    steps = list(zip(bounds[1:-1], bounds[2:], strict=True))  # the first is warm-up; the last has no next
    if not steps:
        return ["no steady steps in this timeline (it needs 3 training steps or more)"]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    tracks = {
        (e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"
    }

    def end(e) -> float:
        return (e["ts"] + e["dur"]) / 1e6

    def covered(spans: list, lo: float, hi: float) -> float:
        return _covered([(e["ts"] / 1e6, end(e)) for e in spans], lo, hi)

    marks: dict[tuple[int, str], list[float]] = defaultdict(list)
    for lo, hi in steps:
        inside = [e for e in events if lo <= e["ts"] / 1e6 < hi]
        marks[(0, "step")].append(hi - lo)
        for pid in range(1, len(processes) + 1):
            mine = [e for e in inside if e["pid"] == pid]
            sends = [e for e in mine if e.get("cat") == "send"]  # replies to the trainer carry no payload
            received = [e for e in mine if e.get("cat") == "receive"]
            if received:
                marks[(pid, "first receive")].append(min(e["ts"] for e in received) / 1e6 - lo)
            if sends:
                busy = covered(sends, lo, hi)
                sent = sum(e["args"].get("bytes", 0) for e in sends)
                marks[(pid, "first send")].append(min(e["ts"] for e in sends) / 1e6 - lo)
                marks[(pid, "last send done")].append(max(end(e) for e in sends) - lo)
                marks[(pid, "sending")].append(busy)
                marks[(pid, "Mbit/s while sending")].append(8 * sent / busy / 1e6 if busy else 0.0)
            if computing := [e for e in mine if tracks.get((pid, e.get("tid"))) == "compute"]:
                marks[(pid, "compute")].append(covered(computing, lo, hi))
            for e in mine:  # the trainer's own: its micro-batches' span, then its step's
                if tracks.get((pid, e.get("tid"))) != "steps":
                    continue
                if e["name"].startswith("micro-batches"):
                    marks[(pid, "replies back")].append(end(e) - lo)
                elif e["name"].startswith("step "):
                    marks[(pid, "its step")].append(e["dur"] / 1e6)
                    marks[(pid, "to the next step")].append(hi - end(e))
    lines = [f"steps {len(steps)} steady, {_spread(marks[(0, 'step')])} s each; seconds from a step's start:"]
    for pid, process in enumerate(processes, start=1):
        found = [(name, values) for (p, name), values in marks.items() if p == pid]
        shown = [
            f"{name} {_spread(v)}" if name != "Mbit/s while sending" else f"{name} {sum(v) / len(v):.1f}"
            for name, v in found
        ]
        lines.append(f"  {process:<14} " + "; ".join(shown))
    return lines


def plot(trace: dict, path: str | Path, window: tuple[float, float] | None = None, title: str = "") -> None:
    """A picture of `window` (default: the second step): a row per peer and track, spans colored by
    what they are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    lo, hi = window or step_window(trace)
    processes = trace["otherData"]["processes"]
    rows = sorted(_spans(trace).items(), key=lambda item: (item[0][0], item[0][1]))
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(rows) + 1.5))
    labels = []
    for y, ((pid, track), spans) in enumerate(rows):
        color = COLORS.get(track.split(" ", 1)[0], "#999999")
        bars = [(s - lo, e - s) for s, e, _ in spans if e > lo and s < hi]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, edgecolor="none")
        labels.append(f"{processes[pid - 1]}: {track}")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    kinds = {"compute": "compute (encode, decode)", "send": "send", "receive": "receive", "await": "await reply"}
    kinds |= {"wait": "wait (order, slot, window)", "step": "step rounds"}
    handles = [matplotlib.patches.Patch(color=COLORS[k], label=label) for k, label in kinds.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncols=3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
