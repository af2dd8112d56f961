"""`python -m swarm bench exact-sum`: its arguments and its run (swarm.bench.exact_sum)."""

from __future__ import annotations

import argparse
import sys


def add_parser(which, positive_int) -> None:
    exact = which.add_parser(
        "exact-sum", help="precision, all-reduce bytes, time and memory of summing a step's gradients exactly"
    )
    exact.add_argument("config", nargs="?", default="configs/demo.yaml", help="experiment YAML (default: the demo)")
    exact.add_argument("--replicas", type=positive_int, default=2, help="peers of a stage in the all-reduce")
    exact.add_argument("--bandwidth", type=float, action="append", help="Mbit/s (default: 100 and 10)")
    exact.add_argument("--delay", type=float, default=50.0, help="one-way delay in ms (default 50)")
    exact.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    exact.add_argument(
        "--memory",
        action="store_true",
        help="instead: what the exact sum adds to a replica's peak memory, GPT-2 small's block (Linux)",
    )
    exact.add_argument("--tokens", type=positive_int, default=1024, help="--memory: tokens a micro-batch (1024)")
    exact.add_argument("--micro_batches", type=positive_int, default=4, help="--memory: micro-batches held (4)")


def run(args: argparse.Namespace) -> int:
    from swarm.bench import exact_sum
    from swarm.config import ConfigError, load_config

    if args.memory:
        from swarm.bench import exact_sum_memory

        found = exact_sum_memory.measure(args.micro_batches, args.tokens)
        print(exact_sum_memory.format_memory(found, args.micro_batches, args.tokens))
        return 0

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.replicas < 2:
        print("error: --replicas: an all-reduce needs at least 2", file=sys.stderr)
        return 2
    report = exact_sum.measure(cfg, args.replicas)
    print(exact_sum.format_report(report, args.bandwidth or [100.0, 10.0], args.delay))
    return 0
