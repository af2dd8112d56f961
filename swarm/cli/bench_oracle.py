"""`python -m swarm bench oracle`: its arguments and its run (swarm.bench.oracle)."""

from __future__ import annotations

import argparse
import sys


def add_parser(which, positive_int) -> None:
    oracle = which.add_parser(
        "oracle", help="a config through the swarm (swarm lab) and in one process: are the losses the same?"
    )
    oracle.add_argument("config", help="experiment YAML (yours: model, data, compression)")
    oracle.add_argument("--stages", type=positive_int, default=2, help="stage peers (default 2)")
    oracle.add_argument("--steps", type=positive_int, default=5, help="optimizer steps in each run (default 5)")
    oracle.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        metavar="REL",
        help="compare within this relative difference, for a model whose kernels are not deterministic "
        "(some GPU ops; default 0: every loss and evaluation the same bits)",
    )
    oracle.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    """0 when every step's loss and every evaluation are one process's, bit for bit (or within `--tolerance`)."""
    from swarm.bench import oracle
    from swarm.config import ConfigError

    try:
        report = oracle.compare(args.config, args.overrides, args.stages, args.steps, args.tolerance)
    except (ConfigError, ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(oracle.format_report(report))
    return 0 if report.same else 1
