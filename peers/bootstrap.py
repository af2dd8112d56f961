"""`python -m peers.bootstrap`: a DHT entry point; prints the multiaddrs other peers join with.

Run it on a reachable machine (e.g. `--host_maddrs /ip4/0.0.0.0/tcp/31337 --identity_path boot.id`
for a stable address) and pass one printed line to every stage and trainer as --initial_peers.
"""

from __future__ import annotations

import argparse
import sys

from peers._common import (
    add_metrics_arg,
    add_network_args,
    fail,
    node_options,
    run_until_stopped,
    say,
    setup_logging,
    start_metrics,
    until_stopped,
)
from swarm.transport.hivemind.monitor.peer_metrics import NodeCollector
from swarm.transport.hivemind.net.node import SwarmNode


async def serve(args: argparse.Namespace) -> int:
    try:
        metrics = start_metrics(args)
    except RuntimeError as e:
        return fail(str(e))
    try:
        node = await SwarmNode.create(node_options(args))
    except RuntimeError as e:
        if metrics is not None:
            metrics.close()
        return fail(str(e))
    try:
        if metrics is not None:
            metrics.add(NodeCollector(node))
        say("bootstrap peer ready; join with --initial_peers and one of:")
        for maddr in await node.maddrs():
            say(maddr)
        await until_stopped()
        say(f"bootstrap reach: {node.reach.summary(node.relay)}")
    finally:
        if metrics is not None:
            metrics.close()
        await node.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m peers.bootstrap", description=__doc__.splitlines()[0])
    add_metrics_arg(parser)
    add_network_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    return run_until_stopped(serve(args))


if __name__ == "__main__":
    sys.exit(main())
