"""`python -m swarm lab`: a whole swarm on this machine (bootstrap, stage peers, trainer), its links
shaped as asked."""

from __future__ import annotations

import argparse
import sys

from swarm.cli import run_outputs


def add_parser(commands, positive_int, non_negative_steps) -> None:
    lab = commands.add_parser(
        "lab", help="a swarm on this machine: bootstrap, stage peers and trainer as separate processes"
    )
    lab.add_argument("config", help="experiment YAML (see configs/)")
    lab.add_argument(
        "--stages",
        type=positive_int,
        required=True,
        help="number of stage peers (the model is split into this many stages)",
    )
    lab.add_argument(
        "--replicas",
        metavar="N|STAGE=N,...",
        help="peers of each stage from the start, each its own process and link: N for every stage, or per stage (1=3,2=2; the others one)",
    )
    lab.add_argument("--results", help="write JSON-lines results here")
    lab.add_argument("--steps", type=positive_int, help="stop after this many optimizer steps")
    lab.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    lab.add_argument("--device", help="cpu, cuda, cuda:N for the stage peers (overrides the config)")
    lab.add_argument(
        "--checkpoint_dir",
        help="the trainer saves checkpoints here (every stage's state) and resumes from the newest one",
    )
    lab.add_argument(
        "--checkpoint_every", type=positive_int, help="steps between checkpoints (default: after every evaluation)"
    )
    lab.add_argument(
        "--snapshot_every",
        type=non_negative_steps,  # refused here, before any peer starts, rather than by the trainer
        help="steps between the copies the swarm keeps of every stage (the trainer's; default 10; 0: none)",
    )
    lab.add_argument(
        "--bandwidth",
        help="shape the links: a rate (100mbit), per process (stage1=20mbit,*=100mbit) or a YAML file {process: rate}",
    )
    lab.add_argument(
        "--delay", help="one-way delay per process link, e.g. 40ms (netem where the kernel has it, else in process)"
    )
    lab.add_argument(
        "--shaping",
        choices=["netns", "inprocess"],
        help="netns: namespaces + tc (default as root); inprocess: peers pace their own sends",
    )
    lab.add_argument("--no_probe", action="store_true", help="skip the link throughput probe before a shaped run")
    lab.add_argument(
        "--trace",
        metavar="FILE",
        help="write the run's timeline here: every peer's spans of computing, sending, receiving and waiting, clocks aligned (Chrome trace JSON: Perfetto, chrome://tracing)",
    )
    lab.add_argument(
        "--no_pacing", action="store_true", help="do not tell the stage peers their link rates (they then send unpaced)"
    )
    lab.add_argument(
        "--churn",
        metavar="SPEC",
        help="stage peers join, die and leave, the trainer dies, during the run: join:1@10,kill:1@30,stop:2@step50,kill:trainer@60 (seconds from the trainer's start, or stepN) or random:SEED[@EVERY]",
    )
    lab.add_argument(
        "--nat",
        metavar="WHO",
        help="put these processes each behind its own NAT router (namespaces): stage numbers and 'trainer', e.g. 1,2; they dial out, nobody dials in",
    )
    run_outputs.add_arguments(lab)


def run(args: argparse.Namespace) -> int:
    from swarm.lab.launch import run_lab
    from swarm.lab.plan import LinkOptions, RunOptions

    if args.checkpoint_every and not args.checkpoint_dir:
        print("error: --checkpoint_every needs --checkpoint_dir", file=sys.stderr)
        return 2
    trainer_args = (["--checkpoint_dir", args.checkpoint_dir] if args.checkpoint_dir else []) + (
        ["--checkpoint_every", str(args.checkpoint_every)] if args.checkpoint_every else []
    )
    if args.snapshot_every is not None:
        trainer_args += ["--snapshot_every", str(args.snapshot_every)]
    try:
        run_outputs.export_options(args)  # refused here, before any peer starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer_args += run_outputs.forwarded(args)
    run_options = RunOptions(
        args.results, args.steps, args.overrides, args.device, trainer_args, args.churn, args.trace, args.replicas
    )
    links = LinkOptions(args.bandwidth, args.delay, args.shaping, not args.no_probe, not args.no_pacing, args.nat)
    return run_lab(args.config, args.stages, run_options, links)
