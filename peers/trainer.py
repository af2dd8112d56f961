"""`python -m peers.trainer --config CFG --initial_peers ...`: drive a run through the swarm.

It publishes the run's config on the DHT (stage peers may join without --config), owns the data and
the schedule, finds the stage peers on the DHT, sets them up, and runs `swarm.training.loop.train`
over a `SwarmPipeline`: the same loop, the same JSON lines as `python -m swarm run`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from peers._common import (
    add_metrics_arg,
    add_network_args,
    add_threads_arg,
    add_trace_arg,
    apply_threads,
    fail,
    node_options,
    say,
    setup_logging,
    start_metrics,
    start_trace,
    write_trace,
)
from swarm.cli import run_outputs
from swarm.transport.hivemind.net.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m peers.trainer", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        required=True,
        help="experiment YAML, published on the DHT for stage peers that join without one (those with one must match it)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    parser.add_argument("--results", help="write JSON-lines results here")
    parser.add_argument(
        "--steps",
        type=int,
        help="stop after this many optimizer steps (the learning-rate schedule then spans them; at most the config's)",
    )
    parser.add_argument("--run_id", default=None, help="the run the stage peers joined (default: the config's name)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one micro-batch")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for every stage to have a peer")
    parser.add_argument(
        "--checkpoint_dir",
        help="save checkpoints (every stage's state, fetched from its peers) here and resume from the newest one",
    )
    parser.add_argument(
        "--checkpoint_every", type=int, help="steps between checkpoints (default: after every evaluation)"
    )
    parser.add_argument(
        "--snapshot_every",
        type=int,
        default=10,
        help="steps between the copies of every stage the swarm keeps (a lost stage or trainer goes back to them; 0: none; default 10)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0 even where the stage peers kept copies of this run from an earlier trainer",
    )
    parser.add_argument(
        "--allow",
        nargs="+",
        action="extend",  # --allow A --allow B: both
        default=[],
        metavar="PEER_ID",
        help="a private run: only these stage peers (and token holders) join",
    )
    parser.add_argument(
        "--private", action="store_true", help="only peers given --allow or a token (python -m peers.token) join"
    )
    run_outputs.add_arguments(parser)  # --export, --merge, --tensorboard
    add_threads_arg(parser)
    add_metrics_arg(parser)
    parser.add_argument(
        "--metrics_linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --metrics_port: keep serving the metrics this long after the run ends (finished or failed), so a scraper sees its last figures (a Prometheus every 5 s: 15; SIGTERM cuts it short; default 0)",
    )
    add_trace_arg(parser)
    add_network_args(parser)
    for action in parser._actions:
        if (
            action.dest == "identity_path"
        ):  # the trainer's identity is the run's owner (its p2p id is its own each start)
            action.help = (
                "the run owner's key (created if missing; default $HIVEPIPE_HOME or ~/.hivepipe/owner.key): it signs "
                "every control call; a trainer started again with the same key takes its run over"
            )
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _linger(metrics, seconds: float) -> None:
    """The metrics stay up `seconds` more: a run shorter than a scrape interval (or its last step)
    would otherwise end before any scraper saw it. SIGTERM or Ctrl-C ends the wait."""
    if seconds <= 0:
        return
    say(f"metrics stay up {seconds:g} s more, at port {metrics.port} (--metrics_linger)")
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


async def _publish(node, run_id: str, path: str, overrides: list[str]):
    """The run's config on the DHT for the whole run, signed as its owner's, unless the run already
    published another."""
    from swarm.transport.hivemind.dht.runconfig import PublishedConfig, start_publishing

    return await start_publishing(node, PublishedConfig.of(run_id, Path(path).read_text(), overrides, path), owned=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C too, whatever was inherited: a trainer started by a script's background job would
    # ignore SIGINT, the signal a lab stops its peers with first, and hold the lab until its SIGTERM
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # imported only now: the training side (models with transformers, data, the loop) takes seconds
    # to import, and a SIGTERM meanwhile (a lab stopping its peers) must already end the trainer cleanly
    from swarm.config import ConfigError, load_config
    from swarm.export.exporter import export_pipeline
    from swarm.training.checkpoints import Checkpointing
    from swarm.training.experiment import build_data, describe, open_results
    from swarm.training.loop import Schedule, train
    from swarm.training.progress import RunProgress, echo_lines
    from swarm.training.tensorboard import TensorBoardRows
    from swarm.transport.hivemind.dht.runstatus import start_status
    from swarm.transport.hivemind.monitor.peer_metrics import NodeCollector
    from swarm.transport.hivemind.monitor.trainer_metrics import TrainerCollector, run_status
    from swarm.transport.hivemind.net.loop import LoopThread
    from swarm.transport.hivemind.net.node import SwarmNode
    from swarm.transport.hivemind.trainer.pipeline import RunAccess, SwarmPipeline
    from swarm.transport.hivemind.trust.keys import IdentityError, default_owner_path, is_peer_id, load_identity

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return fail(str(e))
    if error := apply_threads(args.threads):
        return fail(error)
    if args.steps is not None and args.steps < 1:
        return fail(f"--steps must be a positive integer, got {args.steps}")
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or not args.checkpoint_dir):
        return fail("--checkpoint_every needs --checkpoint_dir and a positive number of steps")
    if bad := [peer for peer in args.allow if not is_peer_id(peer)]:
        return fail(f"--allow takes peer ids, got {bad[0]!r}")
    if args.snapshot_every < 0:
        return fail(f"--snapshot_every must be 0 (no copies) or a positive number of steps, got {args.snapshot_every}")
    if not args.metrics_linger >= 0:  # NaN too
        return fail(f"--metrics_linger must be 0 or a positive number of seconds, got {args.metrics_linger}")
    try:
        export = run_outputs.export_options(args)  # a bad --export fails before the run starts
    except ValueError as e:
        return fail(str(e))
    checkpoint = Checkpointing(args.checkpoint_dir, args.checkpoint_every) if args.checkpoint_dir else None
    run_id = args.run_id or cfg.name
    try:
        settings = Settings.of(call_timeout_s=args.timeout, setup_wait_s=args.wait)
    except ValueError as e:
        return fail(f"--timeout / --wait: {e}")
    try:
        owner_key = load_identity(args.identity_path or default_owner_path())
    except IdentityError as e:
        return fail(str(e))
    args.identity_path = None  # the owner's key, not the trainer's p2p identity (a restarted trainer's daemon is new)
    try:
        metrics = start_metrics(args)  # its port first: a bad one fails before the run is touched
    except RuntimeError as e:
        return fail(str(e))
    loop = LoopThread("trainer-loop")
    try:
        options = node_options(args, client_mode=True, settings=settings)
        options.signing_key = owner_key  # the run's config record is the owner's
        node = loop.run(SwarmNode.create(options))
    except RuntimeError as e:
        loop.stop()
        if metrics is not None:
            metrics.close()
        return fail(str(e))
    publisher = results = reporter = pipeline = board = export_failed = None
    ended = False  # finished or failed, not interrupted: what --metrics_linger holds the metrics for
    start_trace(args, "trainer")
    try:
        data = build_data(cfg)  # first: data that cannot be read leaves no config of a run on the DHT
        publisher = loop.run(_publish(node, run_id, args.config, args.overrides))
        schedule = Schedule.of(cfg, len(data[0]), args.steps)
        pipeline = SwarmPipeline(
            node,
            loop,
            cfg,
            run_id,
            snapshot_every=args.snapshot_every,
            fresh=args.fresh,
            access=RunAccess(owner_key, args.allow, args.private),
        )
        say(f"owner of run {run_id!r}: {pipeline.owner.peer_id} (stage peers may pin it with --owner)")
        progress = RunProgress(schedule.total_steps)  # for the progress lines, status record and metrics
        reporter = loop.run(start_status(node, run_id, lambda: run_status(pipeline, progress)))
        if metrics is not None:
            metrics.add(NodeCollector(node), TrainerCollector(pipeline, progress))
        members = pipeline.setup(schedule.lr_horizon, len(data[0]))
        say(f"run {run_id!r}: " + ", ".join(f"stage {s}: {len(p)} peer(s)" for s, p in sorted(members.items())))
        resumed = pipeline.resumed()  # a run an earlier trainer left: its rows up to there are kept
        if args.tensorboard:
            board = TensorBoardRows(args.tensorboard)
        listeners = [board.observe] if board is not None else []
        at = None if resumed is None else resumed["step"]
        results = open_results(args.results, checkpoint, resumed=at, listeners=listeners)
        results.listeners.append(progress.observe)
        if not sys.stderr.isatty():
            results.listeners.append(echo_lines(progress, say))
        summary = train(cfg, pipeline, data, results, args.steps, progress=sys.stderr.isatty(), checkpoint=checkpoint)
        if export is not None:  # the stages' state of the last step, fetched from its peers
            try:
                for line in export_pipeline(pipeline, cfg, summary["steps"], export):
                    say(line)
            except (ValueError, OSError) as e:  # the run itself finished: it is told so, and finishes
                export_failed = f"--export: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        results.write({"type": "stages", "stages": pipeline.stage_rows()})
        pipeline.finish()
        say(f"trainer reach: {node.reach.summary()}")
        adaptive = pipeline.adaptive_report()  # compression.adaptive: the settings it chose, and why
        ended = True
    except KeyboardInterrupt:
        if pipeline is not None:
            pipeline.state = "interrupted"
        say("interrupted")
        return 130
    except Exception as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if pipeline is not None:
            pipeline.state = f"failed: {message}"
        ended = True
        return fail(message)
    finally:
        write_trace(args, node.peer_id)
        if results is not None:
            results.close()
        if board is not None:
            board.close()
        if metrics is not None:
            if ended:
                _linger(metrics, args.metrics_linger)
            metrics.close()
        try:
            if reporter is not None:  # its last word: finished, interrupted or failed
                loop.run(reporter.refresh(), timeout=10)
                loop.run(reporter.stop(), timeout=20)
            if publisher is not None:
                loop.run(publisher.stop(), timeout=20)
            loop.run(node.shutdown(), timeout=20)
        finally:
            loop.stop()
    for line in describe(summary, args.results):
        say(line)
    if adaptive is not None:
        say(adaptive)
    return fail(export_failed) if export_failed else 0


if __name__ == "__main__":
    sys.exit(main())
