"""WikiText-2 (raw) for causal language modelling, prepared as Hugging Face's run_clm does.

Each row is tokenized on its own with GPT-2's tokenizer; rows are then taken `group_rows` at a
time (run_clm's map batch of 1,000), concatenated, and cut into blocks of `block_size` tokens,
dropping each group's remainder. Items are (block id, input_ids [block_size], labels = input_ids);
the loss shifts.

Sources:
- no `data_dir`: `datasets.load_dataset("wikitext", "wikitext-2-raw-v1")`, train = the train
  split, test = `test_split` (default "validation", what run_clm evaluates on);
- `data_dir`: raw files read as the Hub builder reads them (one row per line, blank lines as "").
  `train_file` / `test_file` name them (defaults wiki.train.raw / wiki.valid.raw). When both name
  the same file, its rows are divided: the first `train_fraction` of them (moved forward to the
  next article heading) for train, the rest for test, e.g. train_file=test_file="wiki.test.raw"
  where only the test split exists.

Block ids run 0..n_train-1 for train and continue n_train.. for test.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

from swarm.config.messages import library_message
from swarm.data.base import SampleDataset, require_dir

HEADING = re.compile(r"^ = [^=].* = \n?$")  # a top-level article title row


class TokenBlocks(SampleDataset):
    """Fixed-length token blocks [N, block_size]; target = input."""

    def __init__(self, ids, blocks: torch.Tensor, vocab_size: int | None = None, seed: int = 0) -> None:
        super().__init__(ids, seed)
        self.blocks = blocks
        self.vocab_size = vocab_size

    def load(self, index: int, sample_id: int):
        block = self.blocks[index]
        return block, block.clone()


def group_texts(
    token_lists: Sequence[Sequence[int]], block_size: int, group_rows: int | None = 1000
) -> list[list[int]]:
    """run_clm's group_texts over batches of `group_rows` rows (None: all rows at once)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if group_rows is not None and (not isinstance(group_rows, int) or group_rows < 1):
        raise ValueError(f"group_rows must be a positive integer or None, got {group_rows!r}")
    step = group_rows if group_rows is not None else max(len(token_lists), 1)
    blocks: list[list[int]] = []
    for start in range(0, len(token_lists), step):
        tokens = list(chain.from_iterable(token_lists[start : start + step]))
        usable = (len(tokens) // block_size) * block_size
        blocks.extend(tokens[i : i + block_size] for i in range(0, usable, block_size))
    return blocks


def read_raw(path: Path) -> list[str]:
    """Rows of a wikitext .raw file as the Hub builder yields them."""
    with open(path, encoding="utf-8") as f:
        return [line if line.strip() else "" for line in f]


def split_rows(rows: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """First `fraction` of the rows (advanced to the next article heading) vs the rest."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"wikitext2: train_fraction must be between 0 and 1, got {fraction!r}")
    cut = int(len(rows) * fraction)
    for i in range(cut, len(rows)):
        if HEADING.match(rows[i]):
            cut = i
            break
    return rows[:cut], rows[cut:]


def load_tokenizer(tokenizer):
    """A tokenizer object as it is, or GPT-2's tokenizer from a hub name / local directory."""
    if not isinstance(tokenizer, (str, Path)):
        return tokenizer
    # transformers' tokenizers load only when a tokenizer is named: runs on other datasets skip them.
    from transformers import GPT2TokenizerFast

    try:
        return GPT2TokenizerFast.from_pretrained(str(tokenizer))
    except Exception as e:  # offline hub name, missing files: one line
        message = library_message(e)
        raise ValueError(
            f"wikitext2: cannot load tokenizer {str(tokenizer)!r} ({message}); pass tokenizer= a local directory"
        ) from None


def tokenize_rows(tokenizer, rows: list[str]) -> list[list[int]]:
    if not rows:
        return []
    try:
        return list(tokenizer(rows, verbose=False)["input_ids"])
    except TypeError:
        return list(tokenizer(rows)["input_ids"])


def token_blocks(
    tokenizer, rows: list[str], block_size: int, group_rows: int | None = 1000
) -> tuple[torch.Tensor, int]:
    """run_clm's blocks [N, block_size] of `rows` and their token count, tokenized one group of rows
    at a time (the same blocks as tokenizing all first): memory holds one group's tokens as Python
    ints and the blocks as int64, not the whole corpus as Python lists."""
    step = group_rows if group_rows is not None else max(len(rows), 1)
    parts, count = [torch.empty(0, block_size, dtype=torch.long)], 0
    for start in range(0, len(rows), step):
        tokens = tokenize_rows(tokenizer, rows[start : start + step])
        count += sum(map(len, tokens))
        blocks = group_texts(tokens, block_size, None)
        if blocks:
            parts.append(torch.tensor(blocks, dtype=torch.long))
    return torch.cat(parts), count


def _hub_rows(test_split: str) -> tuple[list[str], list[str]]:
    try:
        # Hugging Face datasets is a heavy import used only for the Hub's copy; inside the try, a
        # broken install is reported in the same one line as being offline.
        from datasets import load_dataset

        data = load_dataset("wikitext", "wikitext-2-raw-v1")
    except Exception as e:  # offline: one line
        message = library_message(e)
        raise ValueError(
            f"wikitext2: cannot load wikitext-2-raw-v1 from the Hub ({message}); pass data_dir= local raw files"
        ) from None
    if test_split not in data:
        raise ValueError(f"wikitext2: test_split must be one of {', '.join(data)}, got {test_split!r}")
    return list(data["train"]["text"]), list(data[test_split]["text"])


def _local_rows(data_dir: str, train_file: str, test_file: str, train_fraction: float) -> tuple[list[str], list[str]]:
    base = require_dir("wikitext2", data_dir)
    paths = {}
    for role, name in (("train_file", train_file), ("test_file", test_file)):
        path = Path(name) if Path(name).is_absolute() else base / name
        if not path.is_file():
            present = sorted(p.name for p in base.iterdir() if p.is_file())
            raise ValueError(
                f"wikitext2: {role} {str(path)!r} does not exist (files there: {', '.join(present) or 'none'});"
                " set train_file/test_file (the same file splits by train_fraction)"
            )
        paths[role] = path.resolve()
    if paths["train_file"] == paths["test_file"]:
        return split_rows(read_raw(paths["train_file"]), train_fraction)
    return read_raw(paths["train_file"]), read_raw(paths["test_file"])


@dataclass(frozen=True)
class WikitextOptions:
    """WikiText-2's options (a config's `data.options`)."""

    tokenizer: object = "gpt2"
    block_size: int = 1024
    group_rows: int | None = 1000
    train_file: str = "wiki.train.raw"
    test_file: str = "wiki.valid.raw"
    train_fraction: float = 0.9
    test_split: str = "validation"


def build_wikitext2(
    data_dir: str | None = None,
    seed: int = 0,
    options: WikitextOptions = WikitextOptions(),
) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, test) token blocks; `tokenizer` is a hub name, a local directory or a tokenizer object."""
    if not isinstance(options.block_size, int) or isinstance(options.block_size, bool) or options.block_size < 2:
        raise ValueError(f"wikitext2: block_size must be an integer >= 2, got {options.block_size!r}")
    if options.group_rows is not None and (not isinstance(options.group_rows, int) or options.group_rows < 1):
        raise ValueError(f"wikitext2: group_rows must be a positive integer or null, got {options.group_rows!r}")
    if data_dir is not None:
        train_rows, test_rows = _local_rows(data_dir, options.train_file, options.test_file, options.train_fraction)
    else:
        train_rows, test_rows = _hub_rows(options.test_split)
    tok = load_tokenizer(options.tokenizer)
    vocab_size = len(tok) if hasattr(tok, "__len__") else None

    (train_blocks, _), (test_blocks, _) = (
        token_blocks(tok, rows, options.block_size, options.group_rows) for rows in (train_rows, test_rows)
    )
    if len(train_blocks) == 0:
        raise ValueError(f"wikitext2: the train text has fewer than block_size={options.block_size} tokens per group")
    n = len(train_blocks)
    train = TokenBlocks(torch.arange(n), train_blocks, vocab_size, seed)
    test = TokenBlocks(torch.arange(n, n + len(test_blocks)), test_blocks, vocab_size, seed)
    return train, test
