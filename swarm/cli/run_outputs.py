"""What a run leaves besides its results, as `swarm run`, `swarm lab` and peers.trainer take it:
`--export DIR` (the trained model at the run's end, swarm.export), `--merge` (a LoRA run's
adapters merged into it) and `--tensorboard DIR` (event files of every results row)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--export",
        metavar="DIR",
        help="at the run's end, write the trained model here as transformers loads it (or hivepipe's own models: safetensors + config); see python -m swarm export",
    )
    parser.add_argument(
        "--merge", action="store_true", help="with --export: a LoRA run's adapters merged into the base weights"
    )
    parser.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write TensorBoard event files here: losses, evaluations, learning rate, samples/s, bytes per link and codec",
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    """The same options as a trainer's command line (swarm lab starts one)."""
    out = ["--export", args.export] if args.export else []
    out += ["--merge"] if args.merge else []
    return out + (["--tensorboard", args.tensorboard] if args.tensorboard else [])


def export_options(args: argparse.Namespace):
    """The checked ExportOptions of `--export` (None without it); ValueError in one line."""
    if args.merge and not args.export:
        raise ValueError("--merge needs --export")
    if not args.export:
        return None
    from swarm.export.exporter import ExportOptions

    options = ExportOptions(Path(args.export), args.merge)
    options.check()
    return options


def hooks(args: argparse.Namespace, cfg):
    """The RunHooks of these options, and what to close after the run (TensorBoard's writer)."""
    from swarm.training.experiment import RunHooks

    options = export_options(args)
    made = RunHooks()
    board = None
    if args.tensorboard:
        from swarm.training.tensorboard import TensorBoardRows

        board = TensorBoardRows(args.tensorboard)
        made.listeners.append(board.observe)
    if options is not None:

        def export(pipeline, summary: dict) -> None:
            from swarm.export.exporter import export_pipeline

            for line in export_pipeline(pipeline, cfg, summary["steps"], options):
                print(line, file=sys.stderr)

        made.finished = export
    return made, board
