"""What every peer process shares: hivemind/Petals-style network options and a clean shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import torch

from swarm.transport.hivemind.net import loop
from swarm.transport.hivemind.net.node import DAEMON_THREADS, NodeOptions
from swarm.transport.hivemind.net.settings import Settings


def add_network_args(parser: argparse.ArgumentParser, host_default: str = "/ip4/0.0.0.0/tcp/0") -> None:
    net = parser.add_argument_group("network (as in hivemind and Petals)")
    net.add_argument(
        "--initial_peers",
        nargs="*",
        default=[],
        help="multiaddrs of peers already in the swarm (python -m peers.bootstrap prints them)",
    )
    net.add_argument(
        "--host_maddrs", nargs="+", default=[host_default], help="multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337"
    )
    net.add_argument(
        "--announce_maddrs",
        nargs="+",
        default=None,
        help="multiaddrs others should dial (behind NAT or port forwarding)",
    )
    net.add_argument(
        "--identity_path", default=None, help="private key file: a stable peer id across restarts (created if missing)"
    )
    net.add_argument("--no_relay", action="store_true", help="do not use libp2p circuit relays")
    net.add_argument(
        "--use_auto_relay",
        action="store_true",
        help="libp2p's auto relay (a peer behind NAT needs no flag: hivepipe relays its streams, docs/swarm.md)",
    )
    net.add_argument("--startup_timeout", type=float, default=30.0, help="seconds to wait for the p2p daemon to start")
    net.add_argument(
        "--shape_rate",
        default=None,
        help="pace what this peer sends to this rate, in process (e.g. 100mbit; no root needed)",
    )
    net.add_argument(
        "--shape_delay", default=None, help="add this one-way delay to every message this peer sends (e.g. 20ms)"
    )
    net.add_argument(
        "--uplink",
        default=None,
        help="this machine's upload rate (e.g. 100mbit): payloads to each neighbour are paced at their fair share of it",
    )
    net.add_argument(
        "--downlink",
        default=None,
        help="this machine's download rate: neighbours pace what they send here at their share of it",
    )
    net.add_argument(
        "--daemon_threads",
        type=int,
        default=DAEMON_THREADS,
        help=f"threads running this peer's p2p daemon's Go code (its GOMAXPROCS, overriding the environment's; default {DAEMON_THREADS}, far more than a home link needs; 0: Go's default, one per core)",
    )


def add_metrics_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics_port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default: none)",
    )
    parser.add_argument(
        "--metrics_host",
        default="127.0.0.1",
        help="address the metrics listen on (0.0.0.0: every interface, for a Prometheus on another machine)",
    )


def start_metrics(args: argparse.Namespace, collectors=()):
    """The peer's metrics endpoint (collectors: swarm.transport.hivemind.monitor; more may be
    added once the peer runs), or None without --metrics_port; RuntimeError (one line) when the
    port cannot be had."""
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port <= 65535:
        raise RuntimeError(f"--metrics_port must be a TCP port (0-65535), got {args.metrics_port}")
    from swarm.transport.hivemind.monitor.exporter import MetricsServer

    server = MetricsServer(args.metrics_port, collectors, args.metrics_host)
    say(f"metrics at http://{args.metrics_host}:{server.port}/metrics")
    return server


def add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="write this peer's timeline here when it stops (Chrome trace JSON: Perfetto, chrome://tracing; python -m swarm timeline merges several)",
    )


def start_trace(args: argparse.Namespace, process: str) -> None:
    """With --trace: this process records its timeline (swarm.tracing) as `process`."""
    if args.trace:
        from swarm.tracing import TRACER

        TRACER.start(process)


def write_trace(args: argparse.Namespace, peer_id: str) -> None:
    if args.trace:
        from swarm.tracing import TRACER

        TRACER.write(args.trace, peer_id)
        say(f"timeline in {args.trace}")


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of this peer (default: torch's, one per core); give peers that share a machine's cores a share each",
    )


def apply_threads(threads: int | None) -> str | None:
    """Sets torch's CPU threads; returns an error message for a bad count."""
    if threads is None:
        return None
    if threads < 1:
        return f"--threads must be a positive integer, got {threads}"

    torch.set_num_threads(threads)
    return None


def node_options(args: argparse.Namespace, client_mode: bool = False, settings: Settings | None = None) -> NodeOptions:
    return NodeOptions(
        initial_peers=list(args.initial_peers),
        host_maddrs=list(args.host_maddrs),
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        client_mode=client_mode,
        use_relay=not args.no_relay,
        use_auto_relay=args.use_auto_relay,
        startup_timeout=args.startup_timeout,
        shape_rate=args.shape_rate,
        shape_delay=args.shape_delay,
        uplink=args.uplink,
        downlink=args.downlink,
        daemon_threads=args.daemon_threads,
        settings=settings or Settings(),
    )


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def say(text: str) -> None:
    print(text, flush=True)


class StopSignals:
    """SIGINT and SIGTERM as an event, from the moment it is made (a signal that comes early is
    not lost); `count`: how many came."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._got)
            except (ValueError, RuntimeError):  # not the main thread (a peer served inside a test)
                return

    def _got(self) -> None:
        self.count += 1
        self.event.set()

    async def next(self) -> None:
        """Waits for the next signal (at once if one came since the last call)."""
        await self.event.wait()
        self.event.clear()


async def until_stopped() -> None:
    """Waits for SIGINT or SIGTERM."""
    await StopSignals().next()


def run_until_stopped(coro) -> int:
    """asyncio.run, with Ctrl-C and SIGTERM ending the peer cleanly (its `finally` blocks run)."""
    try:
        return loop.run(coro)
    except KeyboardInterrupt:
        return 0


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2
