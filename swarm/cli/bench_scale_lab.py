"""`python -m swarm bench scale-lab`: its arguments and its run (swarm.bench.scale_lab_run)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_POINTS = "2x1 2x2 2x3 2x4 4x1 8x1"


def add_parser(which, positive_int, non_negative_float) -> None:
    lab = which.add_parser(
        "scale-lab",
        help="lab points of a link-bound swarm (replicas, stages): samples/s, routing, all-reduce, memory, the model beside",
    )
    lab.add_argument(
        "config",
        nargs="?",
        default="configs/bench/scale-lab.yaml",
        help="experiment YAML (default: ResNet-18 layer2 boundaries, little compute)",
    )
    lab.add_argument(
        "--points",
        default=DEFAULT_POINTS,
        help="space-separated STAGESxREPLICAS, REPLICAS as swarm lab's --replicas (2x3: 3 of every stage; 3x1=2: stage 1 twice)",
    )
    lab.add_argument(
        "--bandwidth", type=non_negative_float, default=10.0, help="Mbit/s of every process's link, each way"
    )
    lab.add_argument("--delay", type=non_negative_float, default=0.0, help="ms one way on every process's link")
    lab.add_argument(
        "--seconds", type=non_negative_float, default=60.0, help="about this long of steady steps per point"
    )
    lab.add_argument("--keep", help="keep every run's results, timelines and memory in this directory")
    lab.add_argument(
        "--from_kept", metavar="DIR", help="no runs: the rows of the runs kept in DIR (--keep), the model as it is now"
    )
    lab.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    lab.add_argument(
        "--json", default="docs/bench/scale.json", help="rows written here, the model's kept ('' for none)"
    )
    lab.add_argument("--plot", default="docs/bench/scale-lab.png", help="PNG ('' for none)")


def parse_points(text: str) -> list[tuple[int, str]]:
    """`2x1 2x4 3x1=2` -> [(2, "1"), (2, "4"), (3, "1=2")]; ValueError (one line) for anything else."""
    from swarm.lab.plan import parse_replicas

    points = []
    for item in text.split():
        stages, _, replicas = item.partition("x")
        if not stages.isdigit() or int(stages) < 2 or not replicas:
            raise ValueError(f"--points takes STAGESxREPLICAS items (at least 2 stages), got {item!r}")
        parse_replicas(replicas, int(stages))
        points.append((int(stages), replicas))
    if not points:
        raise ValueError("--points: give at least one STAGESxREPLICAS")
    return points


def run(args: argparse.Namespace) -> int:
    from swarm.bench import scale_lab_run, scale_lab_table

    try:
        points = parse_points(args.points)
        if not args.bandwidth > 0:
            raise ValueError("--bandwidth must be a positive number of Mbit/s")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "config": args.config}
    plan = scale_lab_run.ScaleLabPlan(
        args.config, points, args.bandwidth, args.delay, args.seconds, list(args.set), stamp
    )
    try:
        if args.from_kept:  # each row says the commit and date of its run
            rows = scale_lab_run.kept_rows(plan, args.from_kept)
        else:
            rows = scale_lab_run.run_scale_lab(plan, args.keep, lambda line: print(line, flush=True))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(scale_lab_table.table(rows))
    for line in scale_lab_table.scaling(rows):
        print(line)
    if args.json:
        scale_lab_run.write_lab_rows(Path(args.json), rows)
        print(f"rows in {args.json}")
    if args.plot:
        scale_lab_table.plot(
            rows,
            args.plot,
            f"scale lab: {args.config}, {args.bandwidth:g} Mbit/s links (commit {', '.join(dict.fromkeys(r['commit'] for r in rows))}, {rows[0]['date']})",
        )
        print(f"plot in {args.plot}")
    return 0
