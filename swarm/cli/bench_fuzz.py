"""`python -m swarm bench fuzz`: its arguments and its run (swarm.bench.fuzz_swarm)."""

from __future__ import annotations

import argparse
import sys


def add_parser(which, positive_int) -> None:
    fuzz = which.add_parser(
        "fuzz", help="malformed messages at a training run's stage peers: outcomes per category, losses, memory"
    )
    fuzz.add_argument(
        "config", nargs="?", default="configs/smoke.yaml", help="experiment YAML (default: the smoke run)"
    )
    fuzz.add_argument("--count", type=positive_int, default=10_000, help="malformed messages to send")
    fuzz.add_argument("--steps", type=positive_int, default=6, help="training steps meanwhile")
    fuzz.add_argument("--seed", type=int, default=0, help="of the messages")
    fuzz.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    """0 when no message hung a peer, every status call during the floods was answered, every peer
    still serves and the losses are one process's."""
    from swarm.bench import fuzz_swarm
    from swarm.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = fuzz_swarm.run(cfg, args.steps, args.count, args.seed)
    print(fuzz_swarm.format_report(report))
    answered = None not in report.tally.info_s
    ok = report.tally.of("hung") == 0 and answered and report.serving and report.max_loss_diff <= 1e-5
    return 0 if ok else 1
