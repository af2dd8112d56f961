"""`python -m swarm timeline`: several peers' timelines as one, what each spent its time on, a picture."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(commands) -> None:
    timeline = commands.add_parser(
        "timeline",
        help="merge peers' timelines (--trace) into one with aligned clocks; where the time goes; a picture",
    )
    timeline.add_argument(
        "traces", nargs="+", help="timelines peers wrote (python -m peers.* --trace), or a merged one"
    )
    timeline.add_argument("--out", help="write the merged timeline here (Chrome trace JSON)")
    timeline.add_argument("--plot", help="PNG of one step of every peer's tracks")
    timeline.add_argument("--step", type=int, default=1, help="which training step the picture shows (0: the first)")
    timeline.add_argument("--title", default="", help="the picture's title")
    timeline.add_argument(
        "--marks",
        action="store_true",
        help="also when each peer's part of a steady step happens (first payload in and out, last out, sending time and rate, compute), seconds from the step's start",
    )


def _merged(trace) -> bool:
    """Whether a file's JSON is a merged timeline (any JSON may come in: a list, a number)."""
    other = trace.get("otherData") if isinstance(trace, dict) else None
    return isinstance(other, dict) and "processes" in other


def run(args: argparse.Namespace) -> int:
    from swarm import timeline

    try:
        traces = [json.loads(Path(path).read_text()) for path in args.traces]
        merged = (
            traces[0]
            if len(traces) == 1 and _merged(traces[0])
            else timeline.merge([timeline.load(path) for path in args.traces])
        )
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        lines = timeline.where_time_goes(merged) + (timeline.step_marks(merged) if args.marks else [])
    except (TypeError, AttributeError, IndexError, KeyError, ValueError) as e:  # a file that only looks like one
        print(f"error: {args.traces[0]}: its events do not read as a timeline's ({e!r})", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(merged))
        print(f"timeline in {args.out}")
    if args.plot:
        timeline.plot(merged, args.plot, timeline.step_window(merged, args.step), args.title)
        print(f"picture in {args.plot}")
    return 0
