"""Your own dataset code: `data.name: package.module:function`.

The function is called as `function(seed=seed, **options)`, plus `data_dir=` when it takes that
parameter (or **kwargs and data_dir is set), and returns (train, test) datasets. Their items are
- `(sample_id, input, target)`: used as they are; the ids are the function's to keep stable and
  unique across both splits (only the first item of each split is checked, for int ids);
- `(input, target)`: wrapped, with ids by position: 0..n_train-1 for train, n_train.. for test.
Options the function's signature does not take are refused (unless it takes **kwargs).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from swarm.config.options import reject_unknown, resolve_callable
from swarm.data.base import SampleDataset


class IndexedDataset(SampleDataset):
    """A dataset of (input, target) items as (id, input, target), ids counted from `offset`."""

    def __init__(self, inner, offset: int = 0, seed: int = 0) -> None:
        super().__init__(torch.arange(offset, offset + len(inner)), seed)
        self.inner = inner
        # what models and reports may read off a dataset stays readable through the wrapper
        for attr in ("num_classes", "vocab_size", "classes"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def load(self, index: int, sample_id: int):
        x, y = self.inner[index]
        return x, y


def _is_id(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_floating_point() and not value.is_complex()
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _form(name: str, split: str, dataset) -> str | None:
    """'sample' for (id, input, target) items, 'pair' for (input, target), None for an empty split."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"{name}: the {split} split is a {type(dataset).__name__}, not a dataset (no len or indexing)")
    if len(dataset) == 0:
        return None
    item = dataset[0]
    if isinstance(item, (tuple, list)) and len(item) == 3:
        if not _is_id(item[0]):
            raise ValueError(
                f"{name}: {split} items are (sample_id, input, target) with sample_id a {type(item[0]).__name__},"
                " not an int"
            )
        return "sample"
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return "pair"
    shape = f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
    raise ValueError(f"{name}: {split} items must be (sample_id, input, target) or (input, target), got {shape}")


def build_custom(name: str, data_dir: str | None = None, seed: int = 0, **options):
    """(train, test) from the function `name` names, with (sample_id, input, target) items."""
    function = resolve_callable(name, "dataset")
    try:
        params = dict(inspect.signature(function).parameters)
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):  # some builtins have no signature: pass everything, let it decide
        params, var_kw = {}, True
    if "seed" not in params and not var_kw:
        raise ValueError(f"{name}: the function must take a seed argument (for reproducible data)")
    if not var_kw:
        reject_unknown(name, options, [p for p in params if p not in ("seed", "data_dir")])
    # a required parameter left out would otherwise surface as the call's TypeError
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [
        p.name
        for p in params.values()
        if p.kind in named and p.default is p.empty and p.name not in ("seed", "data_dir", *options)
    ]
    if missing:
        raise ValueError(f"{name}: missing option(s) {', '.join(missing)} (the function requires them)")
    if "data_dir" in params or (var_kw and data_dir is not None):
        options["data_dir"] = data_dir
    elif data_dir is not None:
        raise ValueError(f"{name}: data_dir is set but the function takes no data_dir argument")

    result = function(seed=seed, **options)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (
            f"a {type(result).__name__} of {len(result)}"
            if isinstance(result, (tuple, list))
            else f"a {type(result).__name__}"
        )
        raise ValueError(f"{name}: the function must return (train, test) datasets, got {got}")
    train, test = result
    forms = _form(name, "train", train), _form(name, "test", test)
    if forms[0] is None:
        raise ValueError(f"{name}: the train split is empty")
    if forms[1] is not None and forms[1] != forms[0]:
        raise ValueError(
            f"{name}: train and test items differ in form; both must be (sample_id, input, target) or both (input, target)"
        )
    if forms[0] == "sample":
        return train, test
    return IndexedDataset(train, 0, seed), IndexedDataset(test, len(train), seed)
