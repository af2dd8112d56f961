"""Your own text files for causal language modelling, prepared as wikitext2 is (run_clm's way).

Files are read with Hugging Face datasets' packaged builders, chosen by extension or by `format`:
- text (.txt, .raw and any extension not below): one row per line, line breaks kept, as run_clm's
  `load_dataset("text", keep_linebreaks=True)`;
- json (.json, .jsonl), csv (.csv; .tsv tab-separated), parquet (.parquet): one row per record,
  the text in column `field`. A missing value (an empty csv cell, a json null or absent key) is an
  empty row, and the count of them is printed.
Builders stream the local files: nothing goes to the network or into the datasets cache.

Rows are tokenized with `AutoTokenizer` (a local directory, a hub name, or a tokenizer object),
then grouped `group_rows` at a time into `block_size` blocks by wikitext's `group_texts`. Items
are (block id, input_ids, labels = input_ids). The test split is `test_files`, or else the last
`test_fraction` (default 0.1; 0 gives an empty test set) of the train files' rows, in file order.
Block ids run 0..n_train-1 for train and continue n_train.. for test.
"""

from __future__ import annotations

import glob
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config.messages import library_message
from swarm.data.base import require_dir
from swarm.data.wikitext import TokenBlocks, token_blocks

NAME = "text"
# format option -> datasets builder (jsonl and tsv are spellings users reach for)
FORMATS = {"text": "text", "json": "json", "jsonl": "json", "csv": "csv", "tsv": "csv", "parquet": "parquet"}
BYTES = "bytes"  # the tokenizer option for UTF-8 bytes
EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}


_FROM_CWD = " (a relative name is read from the current directory, {}: run from where the config expects, set data_dir, or give an absolute path)"


def resolve_files(patterns, data_dir: str | None, role: str) -> list[Path]:
    """Files of a list of names or globs, relative to `data_dir` (or the cwd), in the given order.

    Globs expand sorted, so the row order (and with it the block ids) does not depend on the
    file system's listing order; a file named twice is read once.
    """
    if isinstance(patterns, (str, Path)):
        patterns = [patterns]
    if not isinstance(patterns, Sequence) or not patterns:
        raise ValueError(f"{NAME}: {role} must be a file, a glob or a list of them, got {patterns!r}")
    base = require_dir(NAME, data_dir) if data_dir is not None else Path.cwd()
    found: dict[Path, None] = {}
    for pattern in patterns:
        if not isinstance(pattern, (str, Path)) or not str(pattern):
            raise ValueError(f"{NAME}: {role} entries must be file names or globs, got {pattern!r}")
        given = Path(pattern).expanduser()
        path = given if given.is_absolute() else base / given
        # a relative name read from where the command runs surprises whoever runs it elsewhere
        where = "" if data_dir is not None or given.is_absolute() else _FROM_CWD.format(base)
        if any(c in str(pattern) for c in "*?["):
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise ValueError(f"{NAME}: {role} pattern {str(path)!r} matches no file{where}")
        elif path.is_file():
            matches = [path]
        else:
            raise ValueError(f"{NAME}: {role} file {str(path)!r} does not exist{where}")
        found.update((m.resolve(), None) for m in matches)
    return list(found)


def file_format(path: Path, format: str | None) -> str:
    """The format option's spelling for a file: `format` when set, else by extension (text when unknown)."""
    return format if format is not None else EXTENSIONS.get(path.suffix.lower(), "text")


def _records(path: Path, fmt: str) -> Iterator[dict]:
    # datasets is a heavy import that only this source (and wikitext2's hub copy) needs. Only
    # reading happens inside the try: the caller's checks raise their own errors between rows.
    from datasets import load_dataset
    from datasets.utils import logging as datasets_logging

    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(logging.CRITICAL)  # its log line of a file it cannot parse: ours says it
    try:
        options = {"text": {"keep_linebreaks": True}, "tsv": {"sep": "\t"}}.get(fmt, {})
        yield from load_dataset(FORMATS[fmt], data_files=[str(path)], split="train", streaming=True, **options)
    except Exception as e:  # unparsable json, a binary file read as csv, ...: one line naming the file
        raise ValueError(f"{NAME}: cannot read {str(path)!r} as {fmt} ({library_message(e)})") from None
    finally:  # for this read only: a later download (wikitext2's hub copy) keeps its messages
        datasets_logging.set_verbosity(verbosity)


def read_rows(path: Path, fmt: str, field: str) -> list[str]:
    """The text rows of one file; `field` is the column of json/csv/parquet records."""
    column = "text" if fmt == "text" else field  # the text builder's one column
    rows, missing = [], 0
    for number, record in enumerate(_records(path, fmt), 1):
        if column not in record:
            raise ValueError(
                f"{NAME}: record {number} of {str(path)!r} has no column {column!r}"
                f" (columns: {', '.join(record) or 'none'}); set field= one of them"
            )
        value = record[column]
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{NAME}: column {column!r} of {str(path)!r} holds {type(value).__name__} values (record {number}),"
                f" not text (columns: {', '.join(record)}); set field= a text column"
            )
        missing += value is None
        rows.append(value or "")
    if missing:  # a json record without the key reads as null too: a misspelt key would vanish unseen
        print(
            f"{NAME}: {missing} of {len(rows)} records of {str(path)!r} {'has' if missing == 1 else 'have'} no {column!r} value"
            " (absent, null or an empty cell): they are read as empty rows",
            file=sys.stderr,
        )
    return rows


def read_files(paths: list[Path], format: str | None, field: str) -> list[str]:
    rows: list[str] = []
    for path in paths:
        rows.extend(read_rows(path, file_format(path, format), field))
    return rows


def load_auto_tokenizer(tokenizer):
    """A tokenizer object as it is, or `AutoTokenizer.from_pretrained` of a local directory or hub name.

    Unlike wikitext2 (GPT-2's tokenizer), any tokenizer transformers can load is accepted; a
    directory needs what `save_pretrained` writes (tokenizer_config.json names the class).
    `bytes` is ByT5's byte-level tokenizer, which needs no files: a small vocabulary keeps a small
    model's output layer small.
    """
    if tokenizer == BYTES:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()  # UTF-8 bytes: a 384-token vocabulary, nothing to download
    if not isinstance(tokenizer, (str, Path)):
        if not callable(tokenizer) or not hasattr(tokenizer, "__len__"):
            raise ValueError(f"{NAME}: tokenizer must be a directory, a hub name or a tokenizer, got {tokenizer!r}")
        return tokenizer
    # transformers loads only when a tokenizer is named: runs on other datasets skip it.
    from transformers import AutoTokenizer

    path = Path(tokenizer).expanduser()
    where = "directory" if path.is_dir() else "hub name (it is not a local directory)"
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else str(tokenizer))
    except Exception as e:  # missing files, offline hub name, unknown class: one line
        raise ValueError(
            f"{NAME}: cannot load tokenizer {str(tokenizer)!r} as a {where} ({library_message(e)})"
        ) from None


def _check(options: TextOptions) -> float:
    """The options' errors before any file is read; returns the test fraction in use."""
    block_size, group_rows, test_fraction = options.block_size, options.group_rows, options.test_fraction
    test_files, format, field = options.test_files, options.format, options.field
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ValueError(f"{NAME}: block_size must be an integer >= 2, got {block_size!r}")
    if group_rows is not None and (not isinstance(group_rows, int) or isinstance(group_rows, bool) or group_rows < 1):
        raise ValueError(f"{NAME}: group_rows must be a positive integer or null, got {group_rows!r}")
    if format is not None and format not in FORMATS:
        raise ValueError(f"{NAME}: format must be one of {', '.join(FORMATS)} (or unset: by extension), got {format!r}")
    if not isinstance(field, str) or not field:
        raise ValueError(f"{NAME}: field must be a column name, got {field!r}")
    if test_files is not None:
        if test_fraction is not None:
            raise ValueError(f"{NAME}: give test_files or test_fraction, not both")
        return 0.0
    fraction = 0.1 if test_fraction is None else test_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise ValueError(f"{NAME}: test_fraction must be a number in [0, 1), got {test_fraction!r}")
    return float(fraction)


@dataclass(frozen=True)
class TextOptions:
    """Local text files' options (a config's `data.options`)."""

    files: str | list[str] | None = None
    tokenizer: str | None = None  # a tokenizer directory or hub name
    field: str = "text"
    block_size: int = 1024
    group_rows: int | None = 1000
    test_files: str | list[str] | None = None
    test_fraction: float | None = None
    format: str | None = None


def build_text(
    data_dir: str | None = None,
    seed: int = 0,
    options: TextOptions = TextOptions(),
) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, test) token blocks of local files; `files`/`test_files` are names or globs."""
    fraction = _check(options)
    if options.files is None:
        raise ValueError(f"{NAME}: files is required (a file, a glob or a list of them)")
    if options.tokenizer is None:
        raise ValueError(f"{NAME}: tokenizer is required (a tokenizer directory or hub name)")
    train_rows = read_files(resolve_files(options.files, data_dir, "files"), options.format, options.field)
    if options.test_files is not None:
        test_rows = read_files(resolve_files(options.test_files, data_dir, "test_files"), options.format, options.field)
    else:
        # the tail, not a random sample: the same files and fraction always give the same split
        cut = len(train_rows) - int(len(train_rows) * fraction)
        train_rows, test_rows = train_rows[:cut], train_rows[cut:]
    tok = load_auto_tokenizer(options.tokenizer)

    (train_blocks, count), (test_blocks, _) = (
        token_blocks(tok, rows, options.block_size, options.group_rows) for rows in (train_rows, test_rows)
    )
    if count == 0:
        raise ValueError(f"{NAME}: the train files hold no text ({len(train_rows)} rows, 0 tokens)")
    if len(train_blocks) == 0:
        raise ValueError(
            f"{NAME}: the train text has {count} tokens, not one block of block_size={options.block_size}"
            f" in any group of group_rows={options.group_rows} rows; lower block_size or add text"
        )
    n = len(train_blocks)
    vocab_size = len(tok)
    train = TokenBlocks(torch.arange(n), train_blocks, vocab_size, seed)
    test = TokenBlocks(torch.arange(n, n + len(test_blocks)), test_blocks, vocab_size, seed)
    return train, test
