"""The tokenizer a config's data names: what turns a language model's tokens back into text (a
sample printed beside the loss) and what an exported model ships with (swarm.export)."""

from __future__ import annotations

from swarm.data.text import load_auto_tokenizer
from swarm.data.wikitext import load_tokenizer


def data_tokenizer(name: str, options: dict):
    """The tokenizer of `text` or `wikitext2` data (None for other data, or text data without
    one); ValueError in one line when it does not load."""
    if name == "text":
        named = options.get("tokenizer")
        return None if named is None else load_auto_tokenizer(named)
    if name == "wikitext2":
        return load_tokenizer(options.get("tokenizer", "gpt2"))
    return None


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A prompt's token ids as the data's rows were tokenized (with the tokenizer's special tokens:
    a Llama tokenizer's BOS), less an end-of-sequence token some append (ByT5's): a prompt goes on."""
    ids = list(tokenizer(text)["input_ids"])
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids[:-1] if ids and eos is not None and ids[-1] == eos else ids
