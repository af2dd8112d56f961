"""Other libraries' errors as our one-line errors: their message's lines joined, a YAML parser's
problem and where it is."""

from __future__ import annotations

ONE_LINE_CHARS = 400  # a library's message past this (a list of every model type) is cut


def library_message(error: BaseException) -> str:
    """An exception's message as one line, for one-line errors (the class name when it has none):
    its lines joined, as what to do is often below the first (transformers: "Couldn't instantiate
    the backend tokenizer from one of: ..." and then which package to install), cut at ONE_LINE_CHARS."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if not text:
        return type(error).__name__
    return text if len(text) <= ONE_LINE_CHARS else text[: ONE_LINE_CHARS - 3].rstrip() + "..."


def yaml_problem(error: Exception) -> str:
    """What a YAML parser refused, and where (its first line alone, "while parsing a block
    mapping", says neither)."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None and mark is None:
        return library_message(error)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem or getattr(error, 'context', None) or type(error).__name__}{where}"
