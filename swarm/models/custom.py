"""User models: `build_model("package.module:function", num_stages, **options)`.

The function is called as `function(num_stages=..., **options)` and returns a StagedModel, or a
`(stages, loss)` / `(stages, loss, metrics)` tuple (default metrics: summed loss, plus accuracy
when the output looks like class logits).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from torch import nn

from swarm.models.base import StagedModel, loss_metrics


def resolve(spec: str) -> Callable:
    """The callable named by "package.module:function" (a dotted attribute path is allowed)."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"custom model {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"custom model {spec!r}: cannot import module {module_name!r} ({e})") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"custom model {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"custom model {spec!r}: {attr!r} is a {type(target).__name__}, not a callable")
    return target


def _as_staged(spec: str, result) -> StagedModel:
    if isinstance(result, StagedModel):
        staged = result
    elif isinstance(result, tuple) and len(result) in (2, 3):
        stages, loss = result[0], result[1]
        if not callable(loss):
            raise ValueError(f"custom model {spec!r}: the loss (second item of the returned tuple) is not callable")
        metrics = result[2] if len(result) == 3 else loss_metrics(loss)
        staged = StagedModel(list(stages), loss, metrics, [])
    else:
        raise ValueError(
            f"custom model {spec!r}: returned {type(result).__name__}; expected a StagedModel or a (stages, loss) tuple"
        )
    staged.stages = list(staged.stages)
    bad = [i for i, stage in enumerate(staged.stages) if not isinstance(stage, nn.Module)]
    if bad:
        raise ValueError(f"custom model {spec!r}: stage {bad[0]} is not a torch.nn.Module")
    return staged


def build_custom(spec: str, num_stages: int, **options) -> StagedModel:
    fn = resolve(spec)
    try:
        inspect.signature(fn).bind(num_stages=num_stages, **options)
    except TypeError as e:
        raise ValueError(
            f"custom model {spec!r}: cannot be called with num_stages and options {sorted(options)} ({e})"
        ) from None
    except ValueError:
        pass  # no signature to check (some builtins): let the call decide
    staged = _as_staged(spec, fn(num_stages=num_stages, **options))
    if len(staged.stages) != num_stages:
        raise ValueError(f"custom model {spec!r}: built {len(staged.stages)} stages, asked for {num_stages}")
    return staged
