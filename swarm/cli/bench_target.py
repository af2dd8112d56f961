"""`python -m swarm bench time-to-target`: its arguments and its run (swarm.bench.time_to_target)."""

from __future__ import annotations

import argparse
import sys

DEFAULT_CONFIG = "configs/bench/time-to-target.yaml"


def add_parser(which, positive_int) -> None:
    ttt = which.add_parser(
        "time-to-target",
        help="training seconds until the evaluation reaches a target, per codec and bandwidth (and torch.distributed's)",
    )
    ttt.add_argument(
        "config", nargs="?", default=DEFAULT_CONFIG, help="experiment YAML (default: a byte-level GPT on WikiText-2)"
    )
    ttt.add_argument("--bandwidth", default="10mbit", help="comma-separated rates of every process link")
    ttt.add_argument("--delay", default="50ms", help="one-way delay of every link ('0' for none)")
    ttt.add_argument(
        "--codecs",
        default="none,quant:4,topk:0.1,adaptive:topk,torch:gloo",
        help="comma-separated, as in bench throughput (torch:gloo: the same stages over torch.distributed, uncompressed)",
    )
    ttt.add_argument(
        "--target",
        default="loss=2.6",
        help="METRIC=VALUE of the evaluation (loss and perplexity: at most; else at least)",
    )
    ttt.add_argument(
        "--max_steps", type=positive_int, default=None, help="stop a run here if it has not reached the target"
    )
    ttt.add_argument("--stages", type=positive_int, default=4, help="stage peers")
    ttt.add_argument("--shaping", choices=["netns", "inprocess"], help="as in lab (default: netns as root)")
    ttt.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ttt.add_argument("--plot", default="time-to-target.png", help="PNG of the metric against seconds ('' for none)")
    ttt.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout (progress on stderr)")


def run(args: argparse.Namespace) -> int:
    from swarm.bench import time_to_target, time_to_target_table
    from swarm.bench.throughput import check_codecs as codec_check
    from swarm.config import ConfigError
    from swarm.config.target import Target
    from swarm.rates import parse_delay, parse_rate

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    bandwidths = [b.strip() for b in args.bandwidth.split(",") if b.strip()]
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    delay = None if args.delay in ("", "0") else args.delay
    try:
        Target.parse(args.target)
        parse_delay(delay)
        for rate in bandwidths:
            parse_rate(rate)
        codec_check(codecs)
        rows = time_to_target.run_time_to_target(
            args.config,
            bandwidths,
            codecs,
            args.target,
            delay,
            args.stages,
            args.max_steps,
            args.shaping,
            args.overrides,
            log,
        )
    except (ConfigError, ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(time_to_target_table.to_json(rows) if args.json else time_to_target_table.format_rows(rows))
    for line in time_to_target_table.target_lines(rows):
        log(line)
    if args.plot and rows:
        time_to_target_table.plot(rows, args.plot, f"time to {rows[0].reaching.target}: {args.config}")
        log(f"plot: {args.plot}")
    return 0
