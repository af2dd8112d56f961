"""The builders a config names: user callables (`package.module:function`) and the options they take."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable


def accepted_options(builder: Callable, skip: Iterable[str] = ()) -> list[str]:
    """The keyword options a builder takes (its parameters, minus the ones the caller fills)."""
    return [p for p in inspect.signature(builder).parameters if p not in set(skip)]


def reject_unknown(what: str, options: dict, allowed: list[str]) -> None:
    """One-line ValueError naming unknown options and the allowed ones."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{what}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")


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


def resolve_callable(spec: str, what: str) -> Callable:
    """The callable "package.module:function" names (a dotted attribute path is allowed); `what`
    ("custom model", "dataset") starts each one-line error."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # not found, or the module's own import failed: one line either way
        first = (str(e).splitlines() or [""])[0][:200]
        raise ValueError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {first})"
        ) from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what} {spec!r}: {attr!r} is a {type(target).__name__}, not a callable")
    return target
