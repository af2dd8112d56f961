"""`python -m swarm bench throughput`: its arguments and its run (swarm.bench.throughput)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(which, positive_int, non_negative_float) -> None:
    throughput = which.add_parser(
        "throughput", help="samples/s of a shaped swarm per codec and bandwidth, against the link and compute bounds"
    )
    throughput.add_argument(
        "config",
        nargs="?",
        default="configs/bench/relay-layer1.yaml",
        help="experiment YAML (default: real ResNet-18 layer1 boundaries, little compute)",
    )
    throughput.add_argument(
        "--bandwidth", default="10mbit,50mbit,100mbit,500mbit", help="comma-separated rates of every process link"
    )
    throughput.add_argument(
        "--codecs",
        default="none,quant:4,topk:0.1",
        help="comma-separated forward specs (TopK gradients reuse the indices; FW|BW to choose; adaptive:topk or adaptive:quant for compression.adaptive; torch:gloo for the same stages over torch.distributed, uncompressed)",
    )
    throughput.add_argument("--stages", type=positive_int, default=4, help="stage peers")
    throughput.add_argument(
        "--steps", type=positive_int, default=4, help="optimizer steps per run (the first warms up)"
    )
    throughput.add_argument(
        "--seconds",
        type=non_negative_float,
        default=20.0,
        help="measure each point for about this long: a codec's faster bandwidths run more steps than --steps, from its slower points' samples/s (0: always --steps)",
    )
    throughput.add_argument(
        "--delay",
        help="one-way delay on every process's link, e.g. 50ms (netem where the kernel has it, else in process)",
    )
    throughput.add_argument("--shaping", choices=["netns", "inprocess"], help="as in lab (default: netns as root)")
    throughput.add_argument("--no_pacing", action="store_true", help="as in lab: stage peers send unpaced")
    throughput.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    throughput.add_argument("--plot", default="throughput.png", help="PNG of samples/s against bandwidth ('' for none)")
    throughput.add_argument(
        "--json", action="store_true", help="print a JSON list of rows on stdout (progress on stderr)"
    )


def run(args: argparse.Namespace) -> int:
    from swarm.bench import throughput, throughput_table
    from swarm.rates import parse_delay, parse_rate

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    bandwidths = [b.strip() for b in args.bandwidth.split(",") if b.strip()]
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    try:
        for rate in bandwidths:
            parse_rate(rate)
        if args.delay is not None:
            parse_delay(args.delay)
        throughput.check_codecs(codecs)
        plan = throughput.ThroughputPlan(
            args.config,
            bandwidths,
            codecs,
            args.stages,
            args.steps,
            list(args.overrides or []),
            args.seconds,
            args.delay,
            args.shaping,
            pacing=not args.no_pacing,
        )
        rows = throughput.run_throughput(plan, log)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(throughput_table.to_json(rows))
    else:
        print(throughput_table.format_rows(rows))
    for (codec, mbit), factor in throughput_table.speedups(rows).items():
        log(f"{codec} at {mbit:g} Mbit/s: {factor:.1f}x the samples/s of none")
    for line in throughput_table.target_lines(rows):
        log(line)
    if args.plot:
        throughput_table.plot(
            rows,
            args.plot,
            f"{Path(args.config).stem}: {args.stages} stages, shaping {rows[0].point.shaping if rows else '-'}",
        )
        log(f"plot written to {args.plot}")
    return 0
