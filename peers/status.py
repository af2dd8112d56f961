"""`python -m peers.status --initial_peers ...`: a table of the swarm read from the DHT and the
peers themselves: runs, stages, peers, addresses, round-trip time, throughput, bytes in/out and
compression ratio per link, last seen."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict

from peers._common import add_network_args, fail, node_options
from swarm.transport.hivemind.node import SwarmNode
from swarm.transport.hivemind.survey import format_table, survey


async def show(args: argparse.Namespace) -> int:
    try:
        node = await SwarmNode.create(node_options(args, client_mode=True))
    except RuntimeError as e:
        return fail(str(e))
    try:
        rows = await survey(node, args.run_id, args.timeout)
    finally:
        await node.shutdown()
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peers.status", description=__doc__.splitlines()[0])
    parser.add_argument("--run_id", default=None, help="only this run")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each peer's answer")
    add_network_args(parser, host_default="/ip4/127.0.0.1/tcp/0")
    args = parser.parse_args(argv)
    if not args.initial_peers:
        return fail("--initial_peers is required (a multiaddr printed by python -m peers.bootstrap)")
    try:
        return asyncio.run(show(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
