"""`python -m swarm.bench.gloo --rank R --world W --master HOST:PORT --config C`: one rank of the
gloo baseline (rank 0 trains, rank i + 1 serves stage i). bench throughput and bench
time-to-target start every rank (swarm.bench.gloo.launch); started by hand, the ranks find each
other at HOST:PORT, the trainer's address.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm.bench.gloo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True, help="0: the trainer; i + 1: stage i")
    parser.add_argument("--world", type=int, required=True, help="stages + 1")
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0, where the ranks meet")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--results", default=None, help="results JSONL (rank 0)")
    parser.add_argument("--steps", type=int, default=None, help="at most this many steps (rank 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a rank waits for another")
    parser.add_argument(
        "--host_maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"], help="the address to use (its IPv4 part)"
    )
    parser.add_argument("--shape_delay", default=None, help="one-way delay added to every message sent (e.g. 20ms)")
    return parser


def interface_of(ip: str) -> str | None:
    """The network interface holding `ip` (gloo binds its connections to one)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return name
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from swarm.config import ConfigError, load_config
    from swarm.engine.delay import synchronous_only
    from swarm.rates import parse_delay

    try:
        stages = args.world - 1
        if stages < 1 or not 0 <= args.rank < args.world:
            raise ValueError(f"--rank must be in 0..{args.world - 1} and --world at least 2")
        cfg = load_config(args.config, [*args.set, f"model.num_stages={stages}"])
        synchronous_only(cfg.train.schedule, "torch.distributed's pipeline")
        delay = parse_delay(args.shape_delay) if args.shape_delay else 0.0
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {args.threads}")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    ip = args.host_maddrs[0].split("/")[2]
    if interface := interface_of(ip):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    print(f"rank {args.rank} of {args.world} joined at {args.master} ({interface or 'default interface'})", flush=True)
    if args.rank == 0:
        from swarm.bench.gloo.run import train_rank

        code = train_rank(cfg, stages, delay, args.results, args.steps)
    else:
        from swarm.bench.gloo.run import stage_rank

        code = stage_rank(cfg, args.rank - 1, stages, delay)
    sys.stdout.flush()
    os._exit(code)  # the receiving threads are blocked in gloo: no orderly interpreter shutdown


if __name__ == "__main__":
    sys.exit(main())
