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
