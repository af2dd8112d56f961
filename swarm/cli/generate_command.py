"""`python -m swarm generate DIR --prompt TEXT`: what an exported language model writes."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands, positive_int, non_negative_float) -> None:
    generate = commands.add_parser("generate", help="text from an exported language model (python -m swarm export)")
    generate.add_argument("model", help="a directory python -m swarm export wrote (or any transformers causal LM)")
    generate.add_argument("--prompt", required=True, help="the text it goes on from")
    generate.add_argument("--max_new_tokens", type=positive_int, default=32, help="tokens to write (default 32)")
    generate.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0: greedy (default); else sampled at this temperature",
    )
    generate.add_argument("--seed", type=int, default=0, help="the sampling's random seed")


def run(args: argparse.Namespace) -> int:
    from swarm.export.generate import Sampling, generate, load_language_model

    try:
        model, tokenizer = load_language_model(args.model)
        text = generate(model, tokenizer, args.prompt, Sampling(args.max_new_tokens, args.temperature, args.seed))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
