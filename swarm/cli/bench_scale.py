"""`python -m swarm bench scale`: its arguments and its run (swarm.bench.scale_sweep)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path


def add_parser(which, positive_int, non_negative_float) -> None:
    scale = which.add_parser(
        "scale", help="the swarm at internet scale, modelled: samples/s, averaging, DHT load, what saturates"
    )
    scale.add_argument("--stages", default="2,4,8,16,32", help="comma-separated stage counts")
    scale.add_argument("--replicas", default="1,2,4,8,16,32", help="comma-separated replicas per stage")
    scale.add_argument("--bandwidth", default="10-100", help="Mbit/s each way, drawn per peer: LOW-HIGH")
    scale.add_argument("--delay", default="20-150", help="one-way delay in ms, drawn per peer: LOW-HIGH")
    scale.add_argument(
        "--compute", default="5-40", help="ms per sample and stage (forward and backward), drawn: LOW-HIGH"
    )
    scale.add_argument(
        "--leave_per_hour", default="0,1", help="comma-separated departures per peer and hour: a sweep for each"
    )
    scale.add_argument("--join_s", type=non_negative_float, default=60.0, help="a replacement's seconds to serve")
    scale.add_argument(
        "--boundary_kib", type=non_negative_float, help="KiB per sample on every boundary (default: a GPT-2 block's)"
    )
    scale.add_argument(
        "--params_mib", type=non_negative_float, help="fp32 MiB of parameters per stage (default: a GPT-2 block's)"
    )
    scale.add_argument("--seed", type=int, default=0, help="the draw of links and compute")
    scale.add_argument(
        "--json", default="docs/bench/scale.json", help="rows written here, the lab's rows kept ('' for none)"
    )
    scale.add_argument("--plot", default="docs/bench/scale-model.png", help="PNG ('' for none)")


def _span(text: str, name: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    try:
        span = (float(low), float(high or low))
    except ValueError:
        raise ValueError(f"--{name}: expected LOW-HIGH, e.g. 10-100, got {text!r}") from None
    if not 0 < span[0] <= span[1]:
        raise ValueError(f"--{name}: expected 0 < LOW <= HIGH, got {text!r}")
    return span


def _counts(text: str, name: str, least: int) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < least:
        raise ValueError(f"--{name}: expected integers >= {least}, got {text!r}")
    return counts


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--leave_per_hour: expected comma-separated numbers, got {text!r}") from None
    if not rates or min(rates) < 0:
        raise ValueError(f"--leave_per_hour: expected numbers >= 0, got {text!r}")
    return rates


def run(args: argparse.Namespace) -> int:
    from swarm.bench import scale_sweep
    from swarm.bench.scale_model import Churn, ScalePoint, Spread, Workload

    try:
        stages, replicas = _counts(args.stages, "stages", 2), _counts(args.replicas, "replicas", 1)
        leaving = _rates(args.leave_per_hour)
        spread = Spread(
            _span(args.bandwidth, "bandwidth"), _span(args.delay, "delay"), _span(args.compute, "compute"), args.seed
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workload = Workload()
    if args.boundary_kib is not None:
        workload = replace(workload, boundary_bytes=args.boundary_kib * 1024)
    if args.params_mib is not None:
        workload = replace(workload, param_bytes=args.params_mib * 2**20)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for rate in leaving:
        print(f"== {rate:g} departures per peer and hour")
        base = ScalePoint(2, 1, workload, spread, Churn(rate, args.join_s))
        rows += scale_sweep.sweep(base, stages, replicas, lambda line: print(line, flush=True))
    stamp = {"commit": commit, "date": time.strftime("%Y-%m-%d")}
    rows = [{**row, **stamp} for row in rows]
    print(scale_sweep.table(rows))
    if args.json:
        scale_sweep.write(Path(args.json), rows)
        print(f"rows in {args.json}")
    if args.plot:
        title = (
            f"scale model: links {args.bandwidth} Mbit/s, {args.delay} ms, compute {args.compute} ms/sample, "
            f"{args.leave_per_hour} departures/peer/h (seed {args.seed}; commit {commit}, {stamp['date']})"
        )
        scale_sweep.plot(rows, args.plot, title)
        print(f"plot in {args.plot}")
    return 0
