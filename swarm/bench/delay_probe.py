"""What one step of gradient delay costs, outside hivepipe: a plain PyTorch loop.

    python -m swarm.bench.delay_probe --delay 1 [--optimizer nadam --beta1 0.99 --lookahead --sync_steps 30]

The time-to-target model (configs/bench/time-to-target.yaml: a byte-level GPT-2, 4 blocks of
width 128, 64-byte blocks of the WikiText-2 test text, the last 98 blocks held out) as one
`GPT2LMHeadModel`, trained with batches of 32 where the gradient of step t is applied at step
t + delay, as an asynchronous pipeline applies it (`train.schedule: async` is delay 1). With no
pipeline, no stages and no codec, it tells whether what `swarm run --set train.schedule=async`
shows is the delay's cost or the engine's. Prints the held-out loss every `--every` steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# as configs/bench/time-to-target.yaml names it: relative to the checkout, where commands run from
TEXT = Path("../shared/data/wikitext-2/wiki.test.raw")
BLOCK, HELD_OUT, BATCH = 64, 98, 32


def _blocks(path: Path) -> torch.Tensor:
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    rows = len(data) // BLOCK
    return data[: rows * BLOCK].view(rows, BLOCK)


def _optimizer(args, params) -> torch.optim.Optimizer:
    betas = (args.beta1, args.beta2)
    if args.optimizer == "nadam":  # Nesterov momentum, decoupled decay: Pluralis' asynchronous runs' optimizer
        return torch.optim.NAdam(params, lr=args.lr, betas=betas, eps=args.eps, decoupled_weight_decay=True)
    return torch.optim.AdamW(params, lr=args.lr, betas=betas, eps=args.eps, weight_decay=0.0)


def run(args) -> list[tuple[int, float]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    blocks = _blocks(Path(args.text))
    test, train = blocks[-HELD_OUT:], blocks[:-HELD_OUT]
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab_size=384, tie_word_embeddings=False)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    params = list(model.parameters())
    optimizer = _optimizer(args, params)
    order = torch.Generator().manual_seed(0)
    late: list[list[torch.Tensor]] = []  # gradients not applied yet, oldest first
    moved = None  # what the last update moved the weights by (--lookahead)
    losses = []
    for step in range(args.steps):
        x = train[torch.randint(0, len(train), (BATCH,), generator=order)]
        weights = [p.detach().clone() for p in params]
        if args.lookahead and moved is not None:  # the gradient at the weights it will be applied to
            with torch.no_grad():
                for p, move in zip(params, moved, strict=True):
                    p.add_(move)
        optimizer.zero_grad()
        model(x, labels=x).loss.backward()
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                p.copy_(w)
        delay = 0 if step < args.sync_steps else args.delay
        late = late if step != args.sync_steps else []  # the switch: what synchronous steps applied is gone
        late.append([p.grad.clone() for p in params])
        if len(late) > delay:
            for p, grad in zip(params, late.pop(0), strict=True):
                p.grad = grad
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            optimizer.step()
            moved = [p.detach() - w for p, w in zip(params, weights, strict=True)]
        if (step + 1) % args.every == 0:
            with torch.no_grad():
                losses.append((step + 1, float(model(test, labels=test).loss)))
            print(f"step {step + 1}: held-out loss {losses[-1][1]:.3f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=int, default=1, help="steps between a gradient and its update (0: in step)")
    parser.add_argument("--sync_steps", type=int, default=0, help="the first steps without delay")
    parser.add_argument("--optimizer", choices=("adamw", "nadam"), default="adamw")
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--grad_clip", type=float, default=1.0, help="0: none")
    parser.add_argument(
        "--lookahead", action="store_true", help="gradients at the weights predicted from the last update"
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10, help="steps between held-out losses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--text", default=str(TEXT), help="the training text (WikiText-2's test file)")
    args = parser.parse_args(argv)
    if args.delay < 0 or args.sync_steps < 0 or args.steps < 1 or args.every < 1:
        parser.error("--delay and --sync_steps must be >= 0, --steps and --every >= 1")
    if not Path(args.text).is_file():
        parser.error(f"--text {args.text}: no such file (../shared/data/README.md says where the data lives)")
    torch.set_num_threads(args.threads)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
