"""swarm.compression.state: SampleStore (memory and disk) and GlobalState."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.compression import GlobalState, SampleStore, StoreFullError
from swarm.compression.state import RowFormat

FORMATS = ["fp32", "fp16", "bf16", "q8", "q6", "q4", "q1"]
ROW = (3, 10)  # 30 values per sample: q6 rows are 23 + 8 bytes, not a multiple of 4


def rows(ids, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((len(ids), *ROW), generator=g) * scale


def row_bound(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """Per-row max error of storing x in fmt."""
    flat = x.reshape(x.shape[0], -1).double()
    if fmt == "fp32":
        return torch.zeros(x.shape[0], dtype=torch.float64)
    if fmt in ("fp16", "bf16"):
        dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
        return torch.finfo(dtype).eps / 2 * flat.abs().amax(dim=1) * 1.0001
    bits = int(fmt[1:])
    span = flat.amax(dim=1) - flat.amin(dim=1)
    return span / ((1 << bits) - 1) / 2 * (1 + 1e-5) + 8 * torch.finfo(torch.float32).eps * flat.abs().amax(dim=1)


def script(store: SampleStore):
    """A fixed sequence of saves; returns what each load gave."""
    results = []
    batches = [[0, 1, 2], [3, 4], [1, 5, 0], [6, 7, 2, 3], [5, 4]]
    for step, ids in enumerate(batches):
        shape = (len(ids), *ROW)
        before, versions = store.load(shape, ids, "cpu")
        results.append((before.clone(), versions))
        value = rows(ids, scale=step + 1.0, seed=step)
        readback = store.save(ids, value, tuple(v + 1 for v in versions))
        after, _ = store.load(shape, ids, "cpu")
        assert torch.equal(readback, after), "save() returns what load() reads back"
        results.append((after.clone(), store.versions(shape, ids)))
    everything, versions = store.load((8, *ROW), list(range(8)), "cpu")
    results.append((everything, versions))
    return results


@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_backed_equals_in_memory(fmt, tmp_path):
    memory = SampleStore(fmt)
    path = tmp_path / f"state-{fmt}.npy"
    disk = SampleStore(fmt, path=path, capacity=8)
    a, b = script(memory), script(disk)
    assert len(a) == len(b)
    for (ta, va), (tb, vb) in zip(a, b, strict=True):
        assert torch.equal(ta, tb)
        assert va == vb
    assert memory.samples == disk.samples == 8
    assert memory.bytes_per_sample == disk.bytes_per_sample
    assert memory.nbytes == disk.nbytes
    # the rows really live in the file
    assert path.exists()
    on_disk = np.load(path, mmap_mode="r")
    assert on_disk.dtype == np.uint8
    assert on_disk.shape == (8, RowFormat(fmt, 30).row_bytes)
    assert int(np.count_nonzero(np.asarray(on_disk))) > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_readback_precision(fmt):
    store = SampleStore(fmt)
    ids = [10, 20, 30, 40]
    x = rows(ids, scale=5.0)
    x[2] = 1.25  # a constant sample
    readback = store.save(ids, x, (1, 1, 1, 1))
    err = (readback.double() - x.double()).reshape(4, -1).abs().amax(dim=1)
    assert bool((err <= row_bound(fmt, x)).all()), (err, row_bound(fmt, x))
    assert torch.equal(readback[2], x[2])
    if fmt == "fp32":
        assert torch.equal(readback, x)
    row_format = RowFormat(fmt, 30)
    assert torch.equal(readback.reshape(4, -1), row_format.decode(row_format.encode(x.reshape(4, -1))))


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_single_known_sample(fmt):
    """Loading a batch where exactly one sample has stored state (or a batch of one)."""
    store = SampleStore(fmt)
    x = rows([0, 1])
    readback = store.save([0, 1], x, (1, 1))
    one, versions = store.load((1, *ROW), [1], "cpu")
    assert versions == (1,)
    assert torch.equal(one[0], readback[1])
    mixed, versions = store.load((2, *ROW), [7, 0], "cpu")
    assert versions == (0, 1)
    assert torch.equal(mixed[0], torch.zeros(ROW))
    assert torch.equal(mixed[1], readback[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_empty_batches(fmt):
    """Zero samples, or samples of zero elements."""
    store = SampleStore(fmt)
    empty, versions = store.load((0, *ROW), [], "cpu")
    assert empty.shape == (0, *ROW) and versions == ()
    assert store.save([], torch.zeros((0, *ROW)), ()).shape == (0, *ROW)
    assert store.samples == 0
    flat = SampleStore(fmt)
    got = flat.save([1, 2], torch.zeros((2, 0)), (1, 1))
    assert got.shape == (2, 0)
    loaded, versions = flat.load((2, 0), [1, 2], "cpu")
    assert loaded.shape == (2, 0) and versions == (1, 1)


def test_full_capacity_raises(tmp_path):
    store = SampleStore("q8", path=tmp_path / "s.npy", capacity=4)
    store.save([0, 1], rows([0, 1]), (1, 1))
    store.save([2, 3], rows([2, 3]), (1, 1))
    assert store.samples == 4
    before, _ = store.load((4, *ROW), [0, 1, 2, 3], "cpu")
    with pytest.raises(StoreFullError):
        store.save([4, 5], rows([4, 5]), (1, 1))
    with pytest.raises(StoreFullError):
        store.save([0, 9], rows([0, 9]), (2, 1))  # one new sample is one too many
    after, versions = store.load((4, *ROW), [0, 1, 2, 3], "cpu")
    assert torch.equal(before, after), "a refused save changes nothing"
    assert versions == (1, 1, 1, 1)
    assert store.samples == 4
    # known samples can still be updated
    store.save([3, 2], rows([3, 2], seed=5), (2, 2))
    assert store.versions((2, *ROW), [2, 3]) == (2, 2)


def test_in_memory_store_grows():
    store = SampleStore("q4")
    for start in range(0, 100, 5):
        ids = list(range(start, start + 5))
        store.save(ids, rows(ids, seed=start), (1,) * 5)
    assert store.samples == 100
    x = rows([95, 96, 97, 98, 99], seed=95)
    got, versions = store.load((5, *ROW), [95, 96, 97, 98, 99], "cpu")
    assert versions == (1,) * 5
    assert bool(((got - x).reshape(5, -1).abs().amax(dim=1) <= row_bound("q4", x).float()).all())


@pytest.mark.parametrize("numel", [1000, 4096, 30000])
def test_bytes_per_sample(numel):
    def store_for(fmt):
        s = SampleStore(fmt)
        s.save([0, 1, 2], torch.randn(3, numel), (1, 1, 1))
        return s

    stores = {fmt: store_for(fmt) for fmt in ("fp32", "fp16", "bf16", "q8", "q6", "q4", "q1")}
    fp32 = stores["fp32"].bytes_per_sample
    assert fp32 >= 4 * numel
    assert 0.24 <= stores["q8"].bytes_per_sample / fp32 <= 0.26 + 32 / numel
    assert stores["q6"].bytes_per_sample / fp32 < 0.25 * (1 + 32 / numel)
    assert 0.49 <= stores["fp16"].bytes_per_sample / fp32 <= 0.51
    assert stores["fp16"].bytes_per_sample == stores["bf16"].bytes_per_sample
    for fmt, s in stores.items():
        bits = 32 if fmt == "fp32" else 16 if fmt in ("fp16", "bf16") else int(fmt[1:])
        assert s.bytes_per_sample >= numel * bits / 8
        assert s.bytes_per_sample <= numel * bits / 8 + 32
        assert s.nbytes == 3 * s.bytes_per_sample
        assert s.samples == 3
    assert [stores[f].bytes_per_sample for f in ("q1", "q4", "q6", "q8")] == sorted(
        stores[f].bytes_per_sample for f in ("q1", "q4", "q6", "q8")
    )


def test_empty_store_reports_zero():
    s = SampleStore("q6")
    assert s.samples == 0 and s.nbytes == 0
    got, versions = s.load((2, *ROW), [3, 4], "cpu")
    assert torch.equal(got, torch.zeros((2, *ROW))) and versions == (0, 0)
    assert s.versions((2, *ROW), [3, 4]) == (0, 0)


def test_shape_change_raises():
    store = SampleStore("q8")
    store.save([0, 1], rows([0, 1]), (1, 1))
    with pytest.raises(ValueError):
        store.save([2], torch.randn(1, 5, 6), (1,))
    with pytest.raises(ValueError):
        store.load((2, 5, 6), [0, 1], "cpu")
    with pytest.raises(ValueError):
        store.save([0, 1], torch.randn(2, 30), (2, 2))  # same numel, different shape


def test_bad_arguments():
    for fmt in ("q0", "q9", "fp8", "int8", "", "Q4"):
        with pytest.raises(ValueError):
            SampleStore(fmt)
    with pytest.raises(ValueError):
        SampleStore("q6", path="/tmp/never-created.npy")  # disk-backed needs a capacity


def test_reset_forgets_samples():
    store = SampleStore("fp16")
    store.save([0, 1], rows([0, 1]), (3, 4))
    store.reset()
    assert store.samples == 0
    got, versions = store.load((2, *ROW), [0, 1], "cpu")
    assert versions == (0, 0)
    assert torch.equal(got, torch.zeros((2, *ROW)))


def test_load_returns_a_copy():
    store = SampleStore("fp32")
    x = rows([0, 1])
    store.save([0, 1], x, (1, 1))
    got, _ = store.load((2, *ROW), [0, 1], "cpu")
    got.add_(100.0)
    again, _ = store.load((2, *ROW), [0, 1], "cpu")
    assert torch.equal(again, x)
    x.add_(5.0)  # the caller's tensor is not kept by reference either
    assert torch.equal(store.load((2, *ROW), [0, 1], "cpu")[0], again)


def test_global_state():
    g = GlobalState()
    zeros, v = g.load((2, 3), None, "cpu")
    assert torch.equal(zeros, torch.zeros(2, 3)) and v == (0,)
    x = torch.randn(2, 3)
    g.save(None, x, (1,))
    got, v = g.load((2, 3), None, "cpu")
    assert torch.equal(got, x) and v == (1,)
    got.add_(1.0)
    x.add_(1.0)
    assert not torch.equal(g.load((2, 3), None, "cpu")[0], got)
    assert g.versions((2, 3), None) == (1,)
    assert g.versions((4,), None) == (0,)
    assert g.nbytes == 6 * 4
    g.save(None, torch.randn(4).half(), (7,))
    assert g.load((4,), None, "cpu")[0].dtype == torch.float32
    assert g.nbytes == 6 * 4 + 4 * 4
    g.reset()
    assert g.nbytes == 0 and g.versions((2, 3), None) == (0,)
