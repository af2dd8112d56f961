"""`python -m swarm ...`: the command line of the library (benchmarks now; runs and reports later)."""

from __future__ import annotations

import argparse
import json
import sys

from swarm.allocator import keep_freed_memory


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm", description="hivepipe: compressed pipeline-parallel training")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print figures")
    which = bench.add_subparsers(dest="bench", required=True)
    codecs = which.add_parser("codecs", help="bits per element, error and speed of every codec")
    codecs.add_argument("--json", action="store_true", help="print a JSON list of rows on stdout")
    codecs.add_argument("--repeat", type=_positive_int, default=3, help="timed repeats per row (median is reported)")
    codecs.add_argument("--scale", type=_positive_float, default=1.0, help="shrink the batch dimension of the tensors (0, 1]")
    return parser


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    if args.command == "bench" and args.bench == "codecs":
        return bench_codecs(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
