"""Tiny language-model runs for the export, sampling and TensorBoard tests: a Llama (pretrained
in a directory of the test's, or from a config) on a small text with a tiny byte-level tokenizer,
and what compares an export with the stages it came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml
from _util import TINY_DECODERS, write_tiny_tokenizer

from swarm.config import config_from_text
from swarm.models.causal_lm import load_model

VOCAB = 300  # the tiny tokenizer has 260 tokens
LLAMA = dict(TINY_DECODERS["llama"], vocab_size=VOCAB, tie_word_embeddings=True)
TEXT = "".join(f"the cat {i} sat on the mat, then the dog {i * 7 % 13} ran.\n" for i in range(200))


def tiny_llama(root: Path, *overrides: str, pretrained: bool = True, lora: dict | None = None, stages: int = 3):
    """A run config: a tiny Llama (tied embedding and head; pretrained: saved under `root`/base
    first, under seed 1), text and tokenizer in `root`."""
    if not (root / "train.txt").is_file():
        root.mkdir(parents=True, exist_ok=True)
        write_tiny_tokenizer(root)
        (root / "train.txt").write_text(TEXT)
    options: dict = {"config": LLAMA}
    if pretrained:
        if not (root / "base").is_dir():
            torch.manual_seed(1)
            load_model(None, LLAMA, None).save_pretrained(root / "base")
        options = {"pretrained": str(root / "base")}
    if lora is not None:
        options.update(lora=lora, split=[0, 2][: stages - 1])  # stage 0: the frozen embedding alone
    raw = {
        "name": "tiny-llama",
        "model": {"name": "transformers", "num_stages": stages, "options": options},
        "data": {
            "name": "text",
            "options": {"files": [str(root / "train.txt")], "tokenizer": str(root), "block_size": 16},
        },
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"},
        "train": {
            "batch_size": 8,
            "micro_batches": 2,
            "eval_batch_size": 16,
            "eval_every": 0.04,
            "eval_compressed": False,
            "max_steps": 4,
        },
        "compression": {"forward": "topk:0.3", "backward": "topk:reuse"},
    }
    return config_from_text(yaml.safe_dump(raw), list(overrides), "tiny-llama")


def probe(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))


def stage_logits(modules, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` through stage modules in order (evaluation mode), as the pipeline runs them."""
    x = tokens
    with torch.no_grad():
        for module in modules:
            module.eval()
            x = module(x)
    return x


def loaded_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


def saved_tensors(directory: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / name))


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files under `directory`, read with TensorBoard's own reader: tag ->
    step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def assert_tensorboard_has_the_rows(directory: Path, rows: list[dict]) -> None:
    """The event files hold each step's loss, learning rate, samples/s and bytes per link (named
    with its codec) and each evaluation's metrics, as the results rows have them (float32)."""
    scalars = tensorboard_scalars(directory)
    f32 = lambda value: float(np.float32(value))  # noqa: E731  (TensorBoard keeps scalars as float32)
    steps = [r for r in rows if r["type"] == "step"]
    assert steps and scalars["train/loss"] == {r["step"]: f32(r["loss"]) for r in steps}
    assert scalars["train/lr"] == {r["step"]: f32(r["lr"]) for r in steps}
    times = [(0, 0.0)] + [(r["samples"], r["time_s"]) for r in steps]
    rates = {r["step"]: f32((n - m) / (t - s)) for r, (m, s), (n, t) in zip(steps, times[:-1], times[1:], strict=True)}
    assert scalars["train/samples_per_s"] == rates
    codecs = next(r for r in rows if r["type"] == "config")["config"]["compression"]
    for link in steps[0]["bytes"]:
        boundary, direction = link.removesuffix(".train").split(".")
        tag = f"bytes/{boundary}.{direction} ({codecs[direction]})"
        assert scalars[tag] == {r["step"]: f32(r["bytes"][link]) for r in steps}
    evals = [r for r in rows if r["type"] == "eval"]
    for metric, value in evals[-1]["uncompressed"].items():
        assert scalars[f"eval/uncompressed/{metric}"][evals[-1]["step"]] == f32(value)
