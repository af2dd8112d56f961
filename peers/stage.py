"""`python -m peers.stage --stage N --initial_peers ... [--run_id RUN] [--config CFG]`: host one stage of a run.

Without --config the peer fetches the config the run published on the DHT (its trainer, or a stage
peer started with --config, publishes it); with --config it must match the published one, and the
peer publishes it too. The peer announces itself on the DHT, waits for the run's trainer to set it
up (weights are built from the config's seed, so every peer of every stage starts from the
single-process run's weights), serves forward/backward micro-batches and steps its own optimizer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from peers._common import (
    StopSignals,
    add_metrics_arg,
    add_network_args,
    add_threads_arg,
    add_trace_arg,
    apply_threads,
    fail,
    node_options,
    run_until_stopped,
    say,
    setup_logging,
    start_metrics,
    start_trace,
    write_trace,
)
from swarm.config import ConfigError, ExperimentConfig, load_config
from swarm.engine.build import device_problem
from swarm.models.registry import stage_count_problem
from swarm.transport.hivemind.dht.runconfig import (
    ConfigPublisher,
    PublishedConfig,
    RunConfigError,
    fetch_configs,
    resolve_run,
    start_publishing,
)
from swarm.transport.hivemind.monitor.stage_metrics import StageCollector
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trust.keys import is_peer_id
from swarm.transport.hivemind.trust.tokens import read_token, token_owner

log = logging.getLogger("peers.stage")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m peers.stage", description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True, help="which stage to host (0-based)")
    parser.add_argument(
        "--config",
        default=None,
        help="experiment YAML, the run's own (default: the config the run published on the DHT)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of --config (use the trainer's overrides)",
    )
    parser.add_argument(
        "--run_id",
        default=None,
        help="the run to join (default: the config's name; without --config, the one run on the DHT)",
    )
    parser.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for the run's config to appear (without --config)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (overrides the config)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the next stage's reply")
    parser.add_argument("--report_every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument(
        "--max_payload_mb", type=float, default=1024.0, help="refuse micro-batch payloads larger than this (MiB)"
    )
    parser.add_argument(
        "--owner",
        default=None,
        help="the peer id of the run's owner (its trainer prints it): only its signed calls are obeyed (default: the signer of the run's published config, else the first trainer to set this peer up)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="a private run's token for this peer (python -m peers.token prints it; keep --identity_path: it names this peer id)",
    )
    add_threads_arg(parser)
    add_metrics_arg(parser)
    add_trace_arg(parser)
    add_network_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    signals = StopSignals()
    if args.config is None and args.overrides:
        return fail("--set needs --config: without it the run's config is fetched as published")
    if not args.wait >= 0:
        return fail(f"--wait must be a number of seconds (0 or more), got {args.wait}")
    if error := apply_threads(args.threads):
        return fail(error)
    if args.owner is not None and not is_peer_id(args.owner):
        return fail(f"--owner must be a peer id (the trainer prints its run's owner), got {args.owner!r}")
    token = None
    if args.token is not None:
        try:
            token = read_token(args.token)
        except ValueError as e:
            return fail(f"--token: {e}")
        if args.owner is None:
            args.owner = token_owner(token)  # the token's signer owns the run
    own = None
    if args.config is not None:  # its problems before the peer joins anything
        try:
            own = _own_config(args)
        except (ConfigError, OSError) as e:
            return fail(str(e))
        if problem := _stage_problem(own[0], args.stage):
            return fail(problem)
    elif args.device and (problem := device_problem(args.device)):  # the peer's own, whatever the run's config
        return fail(problem)
    try:
        settings = Settings.of(call_timeout_s=args.timeout, max_micro_batch_bytes=int(args.max_payload_mb * 2**20))
    except ValueError as e:
        return fail(f"--timeout / --max_payload_mb: {e}")
    metrics = None
    try:
        metrics = start_metrics(args)  # its port first: a bad one fails before the peer joins anything
        node = await SwarmNode.create(node_options(args, settings=settings))
    except RuntimeError as e:
        if metrics is not None:
            metrics.close()
        return fail(str(e))
    if token is not None and token.peer_id != node.peer_id:
        await node.shutdown()
        if metrics is not None:
            metrics.close()
        return fail(
            f"--token is for peer {token.peer_id}, this peer is {node.peer_id}: start it with the --identity_path the token was made for"
        )
    server = StageServer(node)
    publisher: ConfigPublisher | None = None
    try:
        try:
            cfg, run_id, mine, owner = await _config(node, args, own)
            if own is None and (problem := _stage_problem(cfg, args.stage)):  # the published config's
                return fail(problem)
            if mine is not None:  # joiners find the run's config before its trainer starts
                publisher = await start_publishing(node, mine)
        except (ConfigError, RunConfigError, OSError) as e:
            return fail(str(e))
        try:
            hosted = server.host(
                HostedStage(
                    node, run_id, cfg, args.stage, owner=owner, token=token.SerializeToString() if token else b""
                )
            )
        except ValueError as e:
            return fail(str(e))
        start_trace(args, f"stage{args.stage} {node.peer_id[-4:]}")
        await server.start()
        if metrics is not None:
            metrics.add(StageCollector(server, asyncio.get_running_loop()))
        say(f"stage {args.stage}/{cfg.model.num_stages} of run {run_id!r} serving as {node.peer_id}")
        for maddr in await node.maddrs():
            say(f"  listening on {maddr}")
        say(f"  {node.reach.me.describe()}")
        reporter = asyncio.create_task(_report(hosted, args.report_every))
        await signals.next()
        await _leave(server, signals)
        reporter.cancel()
        say(f"stage {args.stage} reach: {node.reach.summary(node.relay)}")
    finally:
        write_trace(args, node.peer_id)
        if metrics is not None:
            metrics.close()
        if publisher is not None:
            await publisher.stop()
        await server.stop()
        await node.shutdown()
    return 0


def _own_config(args: argparse.Namespace) -> tuple[ExperimentConfig, PublishedConfig]:
    """--config with --set and --device, and the record this peer publishes for it."""
    cfg = load_config(args.config, args.overrides + _device(args))
    run_id = args.run_id or cfg.name
    return cfg, PublishedConfig.of(run_id, Path(args.config).read_text(), args.overrides, args.config)


def _device(args: argparse.Namespace) -> list[str]:
    return [f"device={args.device}"] if args.device else []


def _stage_problem(cfg: ExperimentConfig, stage: int) -> str | None:
    """Why this peer cannot host `stage` of `cfg`, found now rather than at the run's setup."""
    if not 0 <= stage < cfg.model.num_stages:
        return f"--stage {stage} does not exist: the config has {cfg.model.num_stages} stages (0..{cfg.model.num_stages - 1})"
    return stage_count_problem(cfg.model.name, cfg.model.num_stages, cfg.model.options) or device_problem(cfg.device)


async def _config(node: SwarmNode, args: argparse.Namespace, own: tuple[ExperimentConfig, PublishedConfig] | None):
    """The run's config and id, what to publish (--config's, or nothing: the config the run
    published), and the run's owner (--owner, or the published config's signer; None: not known yet)."""
    if own is not None:
        cfg, mine = own
        run_id = mine.run_id
        # the run's trainer may have published already: its signed record names the owner
        owners = {c.owner for c in await fetch_configs(node, run_id, args.owner) if c.owner and c.digest == mine.digest}
        return cfg, run_id, mine, args.owner or (owners.pop() if len(owners) == 1 else None)
    published = await resolve_run(node, args.run_id, args.wait, args.owner)
    cfg = published.config(_device(args))  # the device is this peer's own: not part of the digest
    owner = args.owner or published.owner or None
    by = f", owner {owner}" if owner else ""
    say(f"joined run {published.run_id!r}: config {published.digest} as published on the DHT{by}")
    return cfg, published.run_id, None, owner


async def _leave(server: StageServer, signals: StopSignals) -> None:
    """Drains (swarm.transport.hivemind.stage.leaving) unless a second signal says to leave now."""
    said: list[str] = []  # the drain's own lines, which say what it waits for

    def drain_says(line: str) -> None:
        said.append(line)
        say(line)

    drained = asyncio.create_task(server.leave(drain_says))
    again = asyncio.create_task(signals.next())
    # only when draining takes a while and has said nothing yet: a peer stopped after its run
    # finished (a lab's end) leaves at once, and a hint to press Ctrl-C again would only confuse
    if not (await asyncio.wait({drained, again}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED))[0]:
        if not said:
            say("stopping: finishing what this peer holds (Ctrl-C again to leave now)")
        await asyncio.wait({drained, again}, return_when=asyncio.FIRST_COMPLETED)
    for task in (drained, again):
        task.cancel()
    say("left the run" if drained.done() and not drained.cancelled() else "leaving now")


async def _report(hosted: HostedStage, every: float) -> None:
    last = (-1, -1)
    while True:
        await asyncio.sleep(every)
        meters = hosted.meters
        now = (meters.processed, hosted.state.steps)
        if now != last:
            say(f"stage {hosted.stage}: {now[0]} micro-batches, {now[1]} steps, {meters.throughput:.1f} samples/s")
            last = now


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    return run_until_stopped(serve(args))


if __name__ == "__main__":
    sys.exit(main())
