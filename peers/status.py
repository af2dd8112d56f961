"""`python -m peers.status --initial_peers ...`: the swarm read from the DHT and the peers themselves:
runs, stages, peers, addresses, round-trip time, throughput, bytes in/out and compression ratio per
link, last seen. A table once; `--json` the health page's data once; `--serve PORT` the health page,
kept up to date (http://127.0.0.1:PORT/)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from peers._common import StopSignals, add_network_args, fail, node_options, say, setup_logging
from swarm.transport.hivemind.dht.survey import format_table, survey
from swarm.transport.hivemind.monitor.health import REFRESH_S, read_swarm, to_json
from swarm.transport.hivemind.monitor.page import HealthServer
from swarm.transport.hivemind.net.node import SwarmNode

log = logging.getLogger("peers.status")


async def show(args: argparse.Namespace) -> int:
    signals = StopSignals() if args.serve is not None else None
    try:
        node = await SwarmNode.create(node_options(args, client_mode=True))
    except RuntimeError as e:
        return fail(str(e))
    try:
        if args.serve is not None:
            return await _serve(node, args, signals)
        if args.json:
            print(to_json(await read_swarm(node, args.run_id, args.timeout), indent=1))
        else:
            print(format_table(await survey(node, args.run_id, args.timeout)))
    finally:
        await node.shutdown()
    return 0


async def _serve(node: SwarmNode, args: argparse.Namespace, signals: StopSignals) -> int:
    try:
        page = HealthServer(args.serve, args.serve_host)
    except RuntimeError as e:
        return fail(str(e))
    say(f"health page at http://{args.serve_host}:{page.port}/ (Ctrl-C to stop)")
    stopped = asyncio.create_task(signals.next())  # a read in progress is dropped at once
    last: dict | None = None
    try:
        while True:
            reading = asyncio.create_task(read_swarm(node, args.run_id, args.timeout))
            await asyncio.wait({reading, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                reading.cancel()
                break
            try:
                last = reading.result()
                page.update(last)
            except Exception as e:  # the DHT or a peer misbehaving: the page says so and keeps its data
                log.warning("reading the swarm failed: %s", e)
                page.update({**(last or {"generated": 0, "refresh_s": REFRESH_S, "runs": []}), "error": str(e)})
            await asyncio.wait({stopped}, timeout=REFRESH_S)
            if stopped.done():
                break
    finally:
        stopped.cancel()
        page.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peers.status", description=__doc__.splitlines()[0])
    parser.add_argument("--run_id", default=None, help="only this run")
    parser.add_argument(
        "--json", action="store_true", help="print the health page's data (JSON) once instead of a table"
    )
    parser.add_argument(
        "--serve", type=int, default=None, metavar="PORT", help="serve the health page on this port (0: any free one)"
    )
    parser.add_argument(
        "--serve_host", default="127.0.0.1", help="address the health page listens on (0.0.0.0: every interface)"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each peer's answer")
    add_network_args(parser, host_default="/ip4/127.0.0.1/tcp/0")
    args = parser.parse_args(argv)
    if not args.initial_peers:
        return fail("--initial_peers is required (a multiaddr printed by python -m peers.bootstrap)")
    if args.serve is not None and not 0 <= args.serve <= 65535:
        return fail(f"--serve must be a TCP port (0-65535), got {args.serve}")
    if not args.timeout > 0:
        return fail(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.serve is not None:
        setup_logging()
    try:
        return asyncio.run(show(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
