"""Users' own datasets given as package.module:function: ids by position, samples as they are,
and one-line errors for what such a function can get wrong."""

from __future__ import annotations

import sys

import pytest
import torch
from _util import one_line_error

from swarm.data import build_datasets

# ---- package.module:function ---------------------------------------------------------------------

MODULE = """
import torch

def pairs(seed, size=4):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: [(torch.randn(2, generator=g), i % 2) for i in range(n)]
    return make(size), make(2)

def with_dir(seed, data_dir=None):
    assert data_dir is not None, "data_dir is passed to a function that takes it"
    return [(100 + i, torch.full((2,), float(i)), i) for i in range(3)], [(200, torch.zeros(2), 0)]

def anything(**kwargs):
    return [(kwargs["seed"], 0)], []

def needs_size(seed, size):
    return [(0, 1)], []

def no_seed():
    return [], []

def three(seed):
    return [], [], []

def one(seed):
    return [(1, 2)]

def empty(seed):
    return [], [(1, 2)]

def quads(seed):
    return [(0, 1, 2, 3)], []

def float_ids(seed):
    return [(0.5, 1, 2)], []

def mixed(seed):
    return [(0, 1, 2)], [(1, 2)]

def not_data(seed):
    return 3, []

not_callable = 5
"""


@pytest.fixture
def data_module(tmp_path, monkeypatch):
    (tmp_path / "hivepipe_user_data.py").write_text(MODULE)
    (tmp_path / "hivepipe_broken_data.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hivepipe_user_data", "hivepipe_broken_data"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "hivepipe_user_data"


def test_custom_pairs_get_ids_by_position(data_module):
    train, test = build_datasets(f"{data_module}:pairs", seed=3, size=5)
    assert train.ids.tolist() == [0, 1, 2, 3, 4] and test.ids.tolist() == [5, 6]
    sample_id, x, y = train[1]
    assert sample_id == 1 and y == 1 and x.shape == (2,)
    same, _ = build_datasets(f"{data_module}:pairs", seed=3, size=5)
    assert torch.equal(same[1][1], x)
    assert build_datasets(f"{data_module}:anything", seed=9)[0][0] == (0, 9, 0)


def test_custom_samples_are_used_as_they_are(data_module, tmp_path):
    train, test = build_datasets(f"{data_module}:with_dir", data_dir=str(tmp_path))
    assert train[2][0] == 102 and test[0][0] == 200 and isinstance(train, list)


def test_custom_errors_are_one_line(data_module, tmp_path):
    def custom(function, **options):
        return build_datasets(f"{data_module}:{function}", **options)

    one_line_error(
        "no_such_module_xyz:f'?: cannot import module 'no_such_module_xyz'", build_datasets, "no_such_module_xyz:f"
    )
    one_line_error(
        "cannot import module 'hivepipe_broken_data' .*broken on import", build_datasets, "hivepipe_broken_data:f"
    )
    one_line_error("has no attribute 'missing'", custom, "missing")
    one_line_error("'not_callable' is a int, not a callable", custom, "not_callable")
    one_line_error("must take a seed argument", custom, "no_seed")
    one_line_error("unknown option.* width", custom, "pairs", width=3)
    one_line_error("missing option\\(s\\) size", custom, "needs_size")
    one_line_error("data_dir is set but the function takes no data_dir", custom, "pairs", data_dir=str(tmp_path))
    one_line_error("must return \\(train, test\\) datasets, got a tuple of 3", custom, "three")
    one_line_error("must return \\(train, test\\) datasets, got a list of 1", custom, "one")
    one_line_error("the train split is empty", custom, "empty")
    one_line_error("train items must be .* got a tuple of 4", custom, "quads")
    one_line_error("sample_id a float, not an int", custom, "float_ids")
    one_line_error("train and test items differ in form", custom, "mixed")
    one_line_error("the train split is a int, not a dataset", custom, "not_data")
