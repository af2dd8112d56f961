"""`python -m swarm bench time-to-target`: its arguments and its run (swarm.bench.target_estimate)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CONFIG = "configs/bench/time-to-target.yaml"


def _listed(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_parser(which, positive_int) -> None:
    ttt = which.add_parser(
        "time-to-target",
        help="T = steps to a target (one process) x seconds per step (the lab), per optimizer, schedule, codec and link",
    )
    ttt.add_argument(
        "config",
        nargs="?",
        default=DEFAULT_CONFIG,
        help="experiment YAML (default: a byte-level GPT on WikiText-2, 1,000 steps)",
    )
    ttt.add_argument("--optimizers", default="muon", help="comma-separated NAME or NAME:LR (e.g. muon,adamw:0.002)")
    ttt.add_argument(
        "--schedules",
        default="sync,async",
        help="comma-separated sync, async or async:CORRECTION (none, lookahead, dc:L)",
    )
    ttt.add_argument(
        "--codecs",
        default="none,quant:4,lowrank:8/q8,torch:gloo",
        help="comma-separated, as in bench throughput (torch:gloo: sync only)",
    )
    ttt.add_argument("--bandwidth", default="10mbit", help="comma-separated rates of every process link")
    ttt.add_argument(
        "--delays", default="50ms,100ms", help="comma-separated one-way delays of every link ('0' for none)"
    )
    ttt.add_argument(
        "--target",
        default="loss=1.8",
        help="METRIC=VALUE of the evaluation (loss and perplexity: at most; else at least)",
    )
    ttt.add_argument(
        "--lab_steps", type=positive_int, default=12, help="steps of each lab run that measures a step's seconds"
    )
    ttt.add_argument(
        "--real",
        default="best",
        help="'best', 'none', or 'SCHEDULE CODEC': run that point to the target in the lab, at the first link",
    )
    ttt.add_argument("--work", default="runs/time-to-target", help="where the one-process runs are kept (and reused)")
    ttt.add_argument("--jobs", type=positive_int, default=1, help="one-process runs at once (each on one thread)")
    ttt.add_argument("--stages", type=positive_int, default=4, help="stage peers")
    ttt.add_argument("--shaping", choices=["netns", "inprocess"], help="as in lab (default: netns as root)")
    ttt.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ttt.add_argument("--plot", default="", help="PNG of the metric against estimated seconds ('' for none)")
    ttt.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout (progress on stderr)")


def _plan(args: argparse.Namespace):
    from swarm.bench.step_time import LabSetup, Link
    from swarm.bench.target_estimate import Plan
    from swarm.bench.target_steps import Variant
    from swarm.bench.throughput import check_codecs
    from swarm.config import load_config
    from swarm.config.target import Target
    from swarm.rates import parse_delay, parse_rate

    codecs = _listed(args.codecs)
    check_codecs(codecs)
    target = Target.parse(args.target)
    delays = [None if d == "0" else d for d in _listed(args.delays)] or [None]
    for rate in _listed(args.bandwidth):
        parse_rate(rate)
    for delay in delays:
        parse_delay(delay)
    # the lab's short runs follow the whole run's schedule, so their losses are its first ones
    overrides = [*args.overrides, f"model.num_stages={args.stages}"]
    base = load_config(args.config, overrides)
    if base.optimizer.schedule_epochs is None and base.optimizer.schedule_steps is None:
        from swarm.training.experiment import build_data
        from swarm.training.loop import Schedule

        horizon = Schedule.of(base, len(build_data(base)[0])).lr_horizon
        overrides.append(f"optimizer.schedule_steps={horizon}")
    variants = [
        Variant(o, s, c)
        for o in _listed(args.optimizers)
        for s in _listed(args.schedules)
        for c in codecs
        if not (c == "torch:gloo" and s != "sync")
    ]
    links = [Link(b, d, args.shaping) for d in delays for b in _listed(args.bandwidth)]
    plan = Plan(variants, links, target, Path(args.work), args.jobs)
    plan.check()
    load_config(args.config, [*overrides, *variants[0].overrides()])
    return plan, LabSetup(args.config, tuple(overrides), args.stages, args.lab_steps)


def _real(args, rows, plan, setup, log):
    from swarm.bench.target_estimate import run_real

    if args.real == "none":
        return []
    first = [r for r in rows if (r.bandwidth_mbit, r.delay_ms) == (rows[0].bandwidth_mbit, rows[0].delay_ms)]
    if args.real == "best":
        chosen = min((r for r in first if r.T is not None and r.codec != "torch:gloo"), key=lambda r: r.T, default=None)
    else:
        schedule, _, codec = args.real.partition(" ")
        chosen = next((r for r in first if (r.schedule, r.codec) == (schedule, codec)), None)
        if chosen is None:
            raise ValueError(
                f"--real {args.real!r}: no such point among the rows (give SCHEDULE CODEC, e.g. 'async quant:4')"
            )
    return [run_real(chosen, setup, plan.links[0], log)] if chosen is not None else []


def run(args: argparse.Namespace) -> int:
    from swarm.bench import time_to_target_table as table
    from swarm.bench.target_estimate import run_estimates
    from swarm.config import ConfigError

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        plan, setup = _plan(args)
        rows, steps = run_estimates(plan, setup, log)
        rows += _real(args, rows, plan, setup, log)
    except (ConfigError, ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(table.to_json(rows) if args.json else table.format_rows(rows))
    for line in table.target_lines(rows):
        log(line)
    if args.plot and rows:
        table.plot(rows, steps, args.plot, f"time to {plan.target}: {args.config}")
        log(f"plot: {args.plot}")
    return 0
