"""User models: `build_model("package.module:function", num_stages, **options)`.

The function is called as `function(num_stages=..., **options)` and returns a StagedModel, or a
`(stages, loss)` / `(stages, loss, metrics)` tuple (default metrics: summed loss, plus accuracy
when the output looks like class logits).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from swarm.config.options import resolve_callable
from swarm.models.base import StagedModel, loss_metrics


def resolve(spec: str) -> Callable:
    return resolve_callable(spec, "custom model")


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
