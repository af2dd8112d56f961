"""`python -m swarm.bench.evidence_cost`: what a stage peer's signed account of one micro-batch
(`train.verify`, swarm.transport.hivemind.trust.evidence) costs its CPU: hashing the four payloads
it exchanged, signing its account, and checking its downstream's; at a language model's sizes."""

from __future__ import annotations

import argparse
import os
import time

import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.trust.evidence import Author, Hashes, account, check_downstream, sha256
from swarm.transport.hivemind.trust.keys import own_peer_id


def _per_call_ms(fn, repeats: int) -> float:
    fn()
    started = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - started) / repeats * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m swarm.bench.evidence_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sample (a boundary of tokens x width)")
    parser.add_argument("--width", type=int, default=768, help="the model's width (GPT-2 small: 768)")
    parser.add_argument("--samples", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    payload = os.urandom(args.samples * args.tokens * args.width * 4)  # float32 activations, uncompressed
    key = RSAPrivateKey()
    batch = MicroBatch(step=1, index=0, sample_ids=torch.arange(args.samples), targets=torch.zeros(1), attempt=b"a" * 8)
    hashes = Hashes(sha256(payload), sha256(payload), sha256(payload), sha256(payload))
    signed = account(Author(key, "run", "session", 1), batch, hashes, 1.0)
    peer = own_peer_id(key)
    hash_ms = _per_call_ms(lambda: sha256(payload), args.repeats)
    sign_ms = _per_call_ms(lambda: account(Author(key, "run", "session", 1), batch, hashes, 1.0), args.repeats)
    check_ms = _per_call_ms(
        lambda: check_downstream([signed], batch, ("run", 1, peer), hashes.forward_in, hashes.backward_out),
        args.repeats,
    )
    mib = len(payload) / 2**20
    total = 4 * hash_ms + sign_ms + check_ms
    print(f"payload {mib:.1f} MiB ({args.samples} x {args.tokens} tokens x {args.width}, float32)")
    print(f"SHA-256 of one payload: {hash_ms:.2f} ms ({mib / hash_ms * 1e3:.0f} MiB/s)")
    print(f"signing an account (RSA-2048): {sign_ms:.2f} ms; checking the downstream's: {check_ms:.2f} ms")
    print(f"a stage's evidence per micro-batch (4 payloads hashed, 1 signed, 1 checked): {total:.1f} ms of CPU")


if __name__ == "__main__":
    main()
