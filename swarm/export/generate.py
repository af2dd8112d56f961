"""Text from an exported language model (`python -m swarm generate DIR --prompt TEXT`), with
transformers' own `generate`: greedy at temperature 0, else sampled from softmax(logits /
temperature) over the whole vocabulary (no top-k, no top-p), under `seed`. A peft adapter
directory loads onto the base model its adapter_config.json names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config.messages import library_message
from swarm.data.tokenizer import prompt_ids


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0


def load_language_model(directory: str | Path):
    """(model in evaluation mode, tokenizer) of an export; ValueError in one line if it is not one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if (directory / "hivepipe_model.json").is_file():
        raise ValueError(f"{directory}: a hivepipe model export (swarm.export.zoo.load_exported), not a language model")
    try:
        if (directory / "adapter_config.json").is_file():
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(str(directory))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{directory}: no model transformers loads ({library_message(e)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{directory}: no tokenizer (the export wrote none: {library_message(e)})") from None
    return model.eval(), tokenizer


def _positions(model) -> int | None:
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def generate(model, tokenizer, prompt: str, sampling: Sampling) -> str:
    """The prompt and what the model writes after it."""
    ids = prompt_ids(tokenizer, prompt)
    if not ids:
        raise ValueError("--prompt gives no tokens")
    room = _positions(model)
    if room is not None and len(ids) + sampling.max_new_tokens > room:
        raise ValueError(
            f"--max_new_tokens {sampling.max_new_tokens}: the model takes {room} positions, the prompt {len(ids)} of them"
        )
    inputs = torch.tensor([ids])
    settings = {"do_sample": False}
    if sampling.temperature > 0:
        settings = {"do_sample": True, "temperature": sampling.temperature, "top_k": 0, "top_p": 1.0}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(sampling.seed)
    with torch.no_grad():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=pad,
            **settings,
        )
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
