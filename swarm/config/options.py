"""Checking the `options` a config passes to a model or dataset builder."""

from __future__ import annotations

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
