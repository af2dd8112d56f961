"""`python -m swarm ...`: benchmarks, single-process runs, local swarms (lab), and reports.

Each subcommand imports what it runs inside its own function, on purpose: `python -m swarm --help`
and a mistyped argument answer at once, without loading torch, hivemind or matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from swarm.cli import (
    bench_exact_sum,
    bench_fuzz,
    bench_oracle,
    bench_scale,
    bench_scale_lab,
    bench_target,
    bench_throughput,
    export_command,
    generate_command,
    lab_command,
    run_outputs,
    timeline_command,
)
from swarm.cli.allocator import keep_freed_memory


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _non_negative_steps(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 0 (none) or a positive number of steps, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m swarm", description="hivepipe: compressed pipeline-parallel training"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print figures")
    which = bench.add_subparsers(dest="bench", required=True)
    codecs = which.add_parser("codecs", help="bits per element, error and speed of every codec")
    codecs.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout")
    codecs.add_argument("--repeat", type=_positive_int, default=3, help="timed repeats per row (median is reported)")
    codecs.add_argument("--scale", type=_fraction, default=1.0, help="shrink the batch dimension of the tensors (0, 1]")
    streams = which.add_parser(
        "streams", help="CPU and time of a micro-batch exchange on a new hivemind stream against a kept one"
    )
    streams.add_argument("--exchanges", type=_positive_int, default=300, help="exchanges timed per mode")
    streams.add_argument("--payload_kb", type=_positive_int, default=60, help="request size (KiB)")
    streams.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout")
    bench_exact_sum.add_parser(which, _positive_int)
    bench_fuzz.add_parser(which, _positive_int)
    bench_oracle.add_parser(which, _positive_int)
    bench_scale.add_parser(which, _positive_int, _non_negative_float)
    bench_scale_lab.add_parser(which, _positive_int, _non_negative_float)
    bench_target.add_parser(which, _positive_int)
    bench_throughput.add_parser(which, _positive_int, _non_negative_float)
    run = commands.add_parser("run", help="train an experiment in one process (in-process transport)")
    run.add_argument("config", help="experiment YAML (see configs/)")
    run.add_argument("--results", help="write JSON-lines results here")
    run.add_argument(
        "--steps",
        type=_positive_int,
        help="stop after this many optimizer steps (the learning-rate schedule then spans them; at most the config's)",
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set compression.forward=topk:0.1",
    )
    run.add_argument("--device", help="cpu, cuda, cuda:N (overrides the config)")
    run.add_argument(
        "--threads",
        type=_positive_int,
        help="torch CPU threads (default: torch's); a swarm's peers with the same --threads give the same losses",
    )
    run.add_argument("--checkpoint_dir", help="save checkpoints here and resume from the newest one it holds")
    run.add_argument(
        "--checkpoint_every", type=_positive_int, help="steps between checkpoints (default: after every evaluation)"
    )
    run_outputs.add_arguments(run)
    lab_command.add_parser(commands, _positive_int, _non_negative_steps)
    export_command.add_parser(commands)
    generate_command.add_parser(commands, _positive_int, _non_negative_float)
    study = commands.add_parser("study", help="run every unfinished config of a study directory, resumably")
    study.add_argument("configs", help="a directory of experiment YAMLs, e.g. configs/study-cpu")
    study.add_argument("--results_dir", default="runs/study-cpu", help="results (NAME.jsonl) and checkpoints go here")
    study.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only configs whose name matches (glob, or substring); repeatable",
    )
    study.add_argument(
        "--seeds",
        type=_positive_int,
        default=1,
        help="seeds per row the findings compare: the config's seed, +1, ... (other rows run once)",
    )
    study.add_argument(
        "--every_row", action="store_true", help="with --seeds: the rows no finding compares at every seed too"
    )
    study.add_argument("--status", action="store_true", help="print every run's state and exit")
    study.add_argument(
        "--heartbeat",
        type=float,
        default=60.0,
        help="seconds between status lines when stderr is not a terminal (0: none)",
    )
    timeline_command.add_parser(commands)
    report = commands.add_parser("report", help="markdown tables and PNG curves from results")
    report.add_argument("results", nargs="*", help="JSON-lines results files (default: the study's, see --study)")
    report.add_argument(
        "--study",
        default="configs/study-cpu",
        help="without results files: report this study's configs (rows not run yet show as pending)",
    )
    report.add_argument("--results_dir", default="runs/study-cpu", help="where the study's results are")
    report.add_argument("--out", default="docs/results", help="output directory")
    report.add_argument(
        "--mix_commits",
        action="store_true",
        help="allow results of different commits in one table (each row then names its commit)",
    )
    return parser


def run_command(args: argparse.Namespace) -> int:
    from swarm.config import ConfigError, load_config
    from swarm.engine.build import device_problem
    from swarm.training.checkpoints import Checkpointing
    from swarm.training.experiment import describe, run_experiment

    overrides = list(args.overrides) + ([f"device={args.device}"] if args.device else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if problem := device_problem(cfg.device):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.checkpoint_every and not args.checkpoint_dir:
        print("error: --checkpoint_every needs --checkpoint_dir", file=sys.stderr)
        return 2
    checkpoint = Checkpointing(args.checkpoint_dir, args.checkpoint_every) if args.checkpoint_dir else None
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    board = None
    try:
        hooks, board = run_outputs.hooks(args, cfg)
        summary = run_experiment(cfg, args.results, args.steps, sys.stderr.isatty(), checkpoint, hooks)
    except (ValueError, OSError) as e:  # bad model/data options, missing data, unwritable paths
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    finally:
        if board is not None:
            board.close()
    print("\n".join(describe(summary, args.results)))
    return 0


def study_command(args: argparse.Namespace) -> int:
    from swarm.study.entries import discover
    from swarm.study.order import plan
    from swarm.study.progress import format_status
    from swarm.study.runner import StudyLocked, StudyOutput, run_study

    try:
        if args.status:
            print(
                "\n".join(
                    format_status(plan(discover(args.configs, args.results_dir, args.only, args.seeds), args.every_row))
                )
            )
            return 0
        failed = run_study(
            args.configs,
            args.results_dir,
            args.only,
            seeds=args.seeds,
            every_row=args.every_row,
            output=StudyOutput(heartbeat=args.heartbeat),
        )
    except (ValueError, StudyLocked) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1 if failed else 0


def report_command(args: argparse.Namespace) -> int:
    from swarm.study.report import write_report, write_study_report

    try:
        if args.results:
            written = write_report(args.results, args.out, args.mix_commits)
        else:
            written = write_study_report(args.study, args.results_dir, args.out, args.mix_commits)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as e:  # a config line whose sections are not a run's
        print(f"error: a results file's config does not read as a run's ({e!r})", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def bench_codecs(args: argparse.Namespace) -> int:
    import torch

    from swarm.bench import codecs

    torch.manual_seed(0)
    rows = codecs.run(scale=args.scale, repeat=args.repeat, progress=sys.stderr.isatty())
    checks = codecs.targets(rows)
    if args.json:
        json.dump([r.as_dict() for r in rows], sys.stdout, indent=1)
        sys.stdout.write("\n")
        print(codecs.format_targets(checks), file=sys.stderr)
    else:
        print(codecs.format_table(rows))
        print()
        print(codecs.format_targets(checks))
    return 0


def bench_streams(args: argparse.Namespace) -> int:
    from swarm.bench import streams

    try:
        rows = streams.run(args.exchanges, args.payload_kb)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(streams.format_rows(rows, args.payload_kb))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    if args.command == "bench" and args.bench == "codecs":
        return bench_codecs(args)
    if args.command == "bench" and args.bench == "throughput":
        return bench_throughput.run(args)
    if args.command == "bench" and args.bench == "streams":
        return bench_streams(args)
    if args.command == "bench" and args.bench == "exact-sum":
        return bench_exact_sum.run(args)
    if args.command == "bench" and args.bench == "fuzz":
        return bench_fuzz.run(args)
    if args.command == "bench" and args.bench == "oracle":
        return bench_oracle.run(args)
    if args.command == "bench" and args.bench == "scale":
        return bench_scale.run(args)
    if args.command == "bench" and args.bench == "scale-lab":
        return bench_scale_lab.run(args)
    if args.command == "bench" and args.bench == "time-to-target":
        return bench_target.run(args)
    if args.command == "run":
        return run_command(args)
    if args.command == "report":
        return report_command(args)
    if args.command == "study":
        return study_command(args)
    if args.command == "lab":
        return lab_command.run(args)
    if args.command == "timeline":
        return timeline_command.run(args)
    if args.command == "export":
        return export_command.run(args)
    if args.command == "generate":
        return generate_command.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
