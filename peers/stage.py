"""`python -m peers.stage --stage N --config CFG --initial_peers ...`: host one stage of a run.

The peer announces itself on the DHT, waits for the run's trainer to set it up (weights are built
from the config's seed, so every peer of every stage starts from the single-process run's
weights), serves forward/backward micro-batches and steps its own optimizer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from peers._common import (
    add_network_args,
    add_threads_arg,
    apply_threads,
    fail,
    node_options,
    run_until_stopped,
    say,
    setup_logging,
    until_stopped,
)
from swarm.config import ConfigError, load_config
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.settings import Settings
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer

log = logging.getLogger("peers.stage")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m peers.stage", description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True, help="which stage to host (0-based)")
    parser.add_argument("--config", required=True, help="experiment YAML (the trainer must use the same one)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (use the trainer's overrides)",
    )
    parser.add_argument("--run_id", default=None, help="the run to join (default: the config's name)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (overrides the config)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the next stage's reply")
    parser.add_argument("--report_every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument(
        "--max_payload_mb", type=float, default=1024.0, help="refuse micro-batch payloads larger than this (MiB)"
    )
    add_threads_arg(parser)
    add_network_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides + ([f"device={args.device}"] if args.device else []))
    except ConfigError as e:
        return fail(str(e))
    if error := apply_threads(args.threads):
        return fail(error)
    if not 0 <= args.stage < cfg.model.num_stages:
        return fail(
            f"--stage {args.stage} does not exist: the config has {cfg.model.num_stages} stages (0..{cfg.model.num_stages - 1})"
        )
    run_id = args.run_id or cfg.name
    try:
        settings = Settings(call_timeout_s=args.timeout, max_micro_batch_bytes=int(args.max_payload_mb * 2**20))
    except ValueError as e:
        return fail(f"--timeout / --max_payload_mb: {e}")
    try:
        node = await SwarmNode.create(node_options(args, settings=settings))
    except RuntimeError as e:
        return fail(str(e))
    server = StageServer(node)
    try:
        try:
            hosted = server.host(HostedStage(node, run_id, cfg, args.stage))
        except ValueError as e:
            return fail(str(e))
        await server.start()
        say(f"stage {args.stage}/{cfg.model.num_stages} of run {run_id!r} serving as {node.peer_id}")
        for maddr in await node.maddrs():
            say(f"  listening on {maddr}")
        reporter = asyncio.create_task(_report(hosted, args.report_every))
        await until_stopped()
        reporter.cancel()
    finally:
        await server.stop()
        await node.shutdown()
    return 0


async def _report(hosted: HostedStage, every: float) -> None:
    last = (-1, -1)
    while True:
        await asyncio.sleep(every)
        now = (hosted.processed, hosted.steps)
        if now != last:
            say(
                f"stage {hosted.stage}: {hosted.processed} micro-batches, {hosted.steps} steps, {hosted.throughput:.1f} samples/s"
            )
            last = now


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    return run_until_stopped(serve(args))


if __name__ == "__main__":
    sys.exit(main())
