"""swarm.compression codecs: TopK selection, payload sizes, reused indices."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
import torch
from _codec_cases import CODECS, G, group_view, rows_of, through_wire
from _util import DTYPE_IDS, FLOAT_DTYPES, buffers_of, make, parse_pb
from hypothesis import given
from hypothesis import strategies as st

from protocols import PayloadError, bitpack, indices, wire
from protocols import compressed_tensor_pb2 as pb
from swarm.compression import Cast, Quantize, TopK, TopKReuse, parse
from swarm.compression.codecs import selection_of

# ---- 3. TopK -----------------------------------------------------------------------------------


def expected_kept(ratio, n) -> int:
    return math.ceil(Decimal(repr(ratio)) * n)


def kept_counts(enc, shape) -> torch.Tensor:
    rows = rows_of(shape)
    per_row = math.prod(shape) // rows
    return torch.bincount(enc.body.positions // per_row, minlength=rows)


@pytest.mark.parametrize(
    "ratio,n",
    [
        (0.1, 10),
        (0.3, 10),
        (0.7, 10),
        (0.2, 5),
        (0.6, 5),
        (0.01, 100),
        (0.05, 20),
        (0.15, 20),
        (0.35, 20),
        (0.9, 10),
        (0.55, 20),
        (0.001, 1000),
        (0.125, 8),
        (0.3, 7),
        (0.29, 100),
        (0.57, 100),
        (1 / 3, 3),
        (0.1, 1),
        (1.0, 13),
    ],
)
def test_topk_keeps_ceil_ratio_n_per_sample(ratio, n):
    shape = (3, n)
    x = make(shape)
    enc = through_wire(TopK(ratio).encode(x))
    k = expected_kept(ratio, n)
    assert enc.body.kept_per_sample == k
    assert kept_counts(enc, shape).tolist() == [k] * 3


def test_topk_exact_decimal_counts():
    """The ratio's decimal value counts, not its binary float: 0.1 of 10 keeps 1 (not 2)."""
    for ratio, n, k in [(0.1, 10, 1), (0.3, 10, 3), (0.7, 10, 7), (0.6, 5, 3), (0.29, 100, 29), (0.57, 100, 57)]:
        enc = TopK(ratio).encode(make((1, n)))
        assert enc.body.kept_per_sample == k, (ratio, n)


@given(digits=st.integers(1, 6), data=st.data(), n=st.integers(1, 3000))
def test_topk_count_hypothesis(digits, data, n):
    m = data.draw(st.integers(1, 10**digits))
    ratio = m / 10**digits
    x = torch.randn(1, n)
    enc = TopK(ratio).encode(x)
    assert enc.body.kept_per_sample == math.ceil(Decimal(m) / 10**digits * n)
    assert enc.body.positions.numel() == enc.body.kept_per_sample


@pytest.mark.parametrize("ratio", [1e-7, 2e-7, 4e-7])
def test_topk_tiny_ratio_keeps_at_least_one(ratio):
    """ceil(K * n) >= 1 for every K > 0: a tiny ratio still sends something."""
    x = make((2, 100))
    enc = TopK(ratio).encode(x)
    assert enc.body.kept_per_sample == expected_kept(ratio, 100) == 1
    assert kept_counts(enc, (2, 100)).tolist() == [1, 1]


@pytest.mark.parametrize("shape", [(4, 50), (2, 3, 4, 5), (60,)])
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_topk_keeps_largest_magnitudes(shape, ratio, dtype):
    x = make(shape, dtype)
    rows = rows_of(shape)
    flat = x.reshape(rows, -1)
    enc = TopK(ratio).encode(x)
    k = enc.body.kept_per_sample
    out = TopK(ratio).decode(through_wire(enc)).reshape(rows, -1)
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[enc.body.positions] = True
    mask = mask.view(rows, -1)
    ref = torch.topk(flat.abs().double(), k, dim=1).values
    for r in range(rows):
        kept = flat[r][mask[r]].abs().double().sort(descending=True).values
        assert torch.equal(kept, ref[r])
        dropped = flat[r][~mask[r]].abs()
        if dropped.numel():
            assert float(dropped.max()) <= float(kept.min())
        assert torch.equal(out[r][mask[r]], flat[r][mask[r]])
        assert bool((out[r][~mask[r]] == 0).all())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", ["randn", "mostly-zero", "few-levels", "sorted", "periodic", "4d"])
def test_topk_large_rows_exact(kind, dtype):
    """Rows long enough (> 45k values) for any sampling shortcut in the selection: still exactly
    the top ceil(K * n) magnitudes of every sample."""
    g = torch.Generator().manual_seed(11)
    n = 50_000
    if kind == "randn":
        x = torch.randn(2, n, generator=g)
    elif kind == "mostly-zero":
        x = torch.where(torch.rand(2, n, generator=g) < 0.02, torch.randn(2, n, generator=g), torch.zeros(2, n))
    elif kind == "few-levels":
        x = torch.randint(-3, 4, (2, n), generator=g).float()
    elif kind == "sorted":
        x = torch.arange(2 * n, dtype=torch.float32).view(2, n)
    elif kind == "periodic":
        x = (torch.arange(2 * n) % 11 == 0).float().view(2, n) * (1 + torch.rand(2, n, generator=g))
    else:
        x = torch.randn(2, 64, 30, 30, generator=g)
    x = x.to(dtype)
    rows = x.shape[0]
    flat = x.reshape(rows, -1)
    for ratio in (0.01, 0.1, 0.3):
        enc = TopK(ratio).encode(x)
        k = expected_kept(ratio, flat.shape[1])
        assert enc.body.kept_per_sample == k
        pos = enc.body.positions
        assert bool((pos.diff() > 0).all())
        mask = torch.zeros(x.numel(), dtype=torch.bool)
        mask[pos] = True
        mask = mask.view(rows, -1)
        for r in range(rows):
            kept = flat[r][mask[r]].abs().double().sort(descending=True).values
            assert kept.numel() == k
            assert torch.equal(kept, torch.topk(flat[r].abs().double(), k).values), (kind, ratio, r)


def test_topk_ties():
    x = torch.tensor([[1.0, -1.0, 2.0, 1.0, -1.0, -2.0, 1.0, 1.0, -1.0, 1.0], [0.0] * 10, [3.0] * 10])
    for ratio, k in [(0.3, 3), (0.5, 5), (0.1, 1), (0.2, 2)]:
        enc = through_wire(TopK(ratio).encode(x))
        assert enc.body.kept_per_sample == k
        assert kept_counts(enc, x.shape).tolist() == [k] * 3
        out = TopK(ratio).decode(enc)
        for r in range(3):
            kept = x[r].reshape(-1)[enc.body.positions[(enc.body.positions // 10) == r] % 10]
            assert torch.equal(kept.abs().sort().values, torch.topk(x[r].abs(), k).values.sort().values)
        assert torch.equal(out[0].abs().sort(descending=True).values[:k], torch.topk(x[0].abs(), k).values)
        assert torch.equal(out[2][out[2] != 0], torch.full((k,), 3.0))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_topk_ratio_one_keeps_everything(dtype):
    x = make((3, 7), dtype)
    x[1, 2] = 0.0
    enc = through_wire(TopK(1.0).encode(x))
    assert enc.body.kept_per_sample == 7
    assert torch.equal(enc.body.positions, torch.arange(21))
    assert torch.equal(TopK(1.0).decode(enc), x)


@pytest.mark.parametrize("ratio", [0.005, 0.01, 0.05, 0.1, 0.12, 0.13, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(4, 1000), (2, 300), (1, 8), (3, 9)])
def test_index_coding_picks_the_smaller(ratio, shape):
    x = make(shape)
    enc = TopK(ratio).encode(x)
    payload = wire.encode(enc)
    msg = parse_pb(payload)
    pos = enc.body.positions
    total = x.numel()
    varint = indices.encode_varint(pos)
    bitmap = indices.encode_bitmap(pos, total)
    assert bitmap.numel() == indices.bitmap_length(total)
    assert torch.equal(indices.decode_varint(varint, pos.numel(), total), pos)
    assert torch.equal(indices.decode_bitmap(bitmap, total), pos)
    sent = msg.sparse.indices
    assert len(sent) == min(varint.numel(), bitmap.numel())
    if varint.numel() < bitmap.numel():
        assert msg.sparse.index_coding == pb.DELTA_VARINT
        assert sent == bytes(varint.tolist())
    elif bitmap.numel() < varint.numel():
        assert msg.sparse.index_coding == pb.BITMAP
        assert sent == bytes(bitmap.tolist())
    assert torch.equal(wire.decode(payload).body.positions, pos)


def test_both_index_codings_occur():
    codings = set()
    for ratio in (0.01, 0.5):
        codings.add(parse_pb(wire.encode(TopK(ratio).encode(make((4, 1000))))).sparse.index_coding)
    assert codings == {pb.DELTA_VARINT, pb.BITMAP}


# ---- 4. payload sizes --------------------------------------------------------------------------

HEADER = 64  # generous bound on everything that is not a buffer (tags, lengths, shape, crc)


def overhead(payload: bytes) -> int:
    return len(payload) - sum(len(b) for b in buffers_of(parse_pb(payload)))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("shape", [(8, 3, 10, 10), (1000,), (5, 333)])
def test_quant_payload_size(bits, granularity, shape):
    x = make(shape)
    n = x.numel()
    payload = wire.encode(Quantize(bits, granularity).encode(x))
    msg = parse_pb(payload)
    groups = group_view(x, granularity).shape[0]
    assert len(msg.quantized.codes) == bitpack.packed_length(n, bits)
    assert len(msg.quantized.codes) <= math.ceil(n * bits / 8) + 2
    assert len(msg.quantized.lows) == len(msg.quantized.steps) == 4 * groups
    assert msg.buffer_length == len(msg.quantized.codes) + 8 * groups
    assert 0 < overhead(payload) <= HEADER
    assert len(payload) <= math.ceil(n * bits / 8) + 2 + 8 * groups + HEADER
    bits_per_element = len(payload) * 8 / n
    assert bits <= bits_per_element <= bits + (2 + 8 * groups + HEADER) * 8 / n


@pytest.mark.parametrize("name,itemsize", [("none", 4), ("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_cast_payload_size(name, itemsize):
    x = make((16, 100))
    payload = wire.encode(CODECS[name].encode(x))
    msg = parse_pb(payload)
    assert len(msg.raw.data) == itemsize * x.numel()
    assert 0 < overhead(payload) <= HEADER


@pytest.mark.parametrize("shape", [(4, 1000), (16, 250), (2, 8, 16, 16)])
def test_topk_fp16_payload_size(shape):
    x = make(shape)
    n = x.numel()
    enc = TopK(0.1, Cast(torch.float16)).encode(x)
    payload = wire.encode(enc)
    msg = parse_pb(payload)
    kept = enc.body.kept_per_sample * rows_of(shape)
    assert kept == math.ceil(0.1 * (n // rows_of(shape)) - 1e-9) * rows_of(shape)
    assert len(msg.sparse.raw_values.data) == 2 * kept
    assert len(msg.sparse.indices) <= indices.bitmap_length(n)
    assert len(payload) <= 2 * kept + indices.bitmap_length(n) + HEADER
    # about 16 * 0.1 + at most one bit per element for the positions
    assert len(payload) * 8 / n <= 16 * 0.1 + 1 + HEADER * 8 / n


def test_topk_quantized_values_size():
    x = make((4, 1000))
    enc = TopK(0.1, Quantize(8, G.SAMPLE)).encode(x)
    msg = parse_pb(wire.encode(enc))
    q = msg.sparse.quantized_values
    assert len(q.codes) == 4 * 100
    assert len(q.lows) == len(q.steps) == 4 * 4
    q4 = parse_pb(wire.encode(TopK(0.1, Quantize(4, G.SAMPLE)).encode(x))).sparse.quantized_values
    assert len(q4.codes) == 4 * 100 // 2


# ---- 5. reused indices -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fwd_spec,back_spec",
    [
        ("topk:0.1/fp16", "topk:reuse/fp16"),
        ("topk:0.3", "topk:reuse"),
        ("topk:0.05/q8", "topk:reuse/q4"),
        ("topk:0.5/bf16", "topk:reuse/bf16"),
    ],
)
def test_reused_index_gradient(fwd_spec, back_spec):
    fwd, back = parse(fwd_spec), parse(back_spec)
    assert back.reuses_indices and not fwd.reuses_indices
    x = make((4, 6, 10))
    grad = make((4, 6, 10))
    # forward: stage A sends the activation, stage B receives it
    out = fwd.sender().send(x)
    inc = fwd.receiver().receive(wire.decode(out.payload))
    assert out.selection is not None and inc.selection is not None
    assert out.selection.digest == inc.selection.digest
    assert out.selection.kept_per_sample == inc.selection.kept_per_sample
    assert torch.equal(out.selection.positions, inc.selection.positions)
    # backward: B sends the gradient at the same positions, A receives it
    bout = back.sender().send(grad, reuse=inc.selection)
    msg = parse_pb(bout.payload)
    assert msg.sparse.index_coding == pb.REUSED
    assert msg.sparse.indices == b""
    assert len(bout.payload) < len(out.payload) - len(parse_pb(out.payload).sparse.indices) + 16
    binc = back.receiver().receive(wire.decode(bout.payload), reuse=out.selection)
    mask = torch.zeros(grad.numel(), dtype=torch.bool)
    mask[out.selection.positions] = True
    mask = mask.view(grad.shape)
    assert binc.tensor.shape == grad.shape and binc.tensor.dtype == grad.dtype
    assert bool((binc.tensor[~mask] == 0).all())
    values = back.codec.inner
    if isinstance(values, Cast):
        wire_dtype = values.wire_dtype or grad.dtype
        assert torch.equal(binc.tensor[mask], grad[mask].to(wire_dtype).to(grad.dtype))
    else:
        bound = (grad[mask].max() - grad[mask].min()) / ((1 << values.bits) - 1) / 2
        assert float((binc.tensor[mask] - grad[mask]).abs().max()) <= float(bound) * 1.0001 + 1e-6


def test_reused_index_rejects_mismatched_selection():
    fwd = parse("topk:0.1/fp16")
    back = parse("topk:reuse/fp16")
    x, other, grad = make((4, 50)), make((4, 50)), make((4, 50))
    out = fwd.sender().send(x)
    other_out = fwd.sender().send(other)
    assert other_out.selection.digest != out.selection.digest
    bout = back.sender().send(grad, reuse=out.selection)
    receiver = back.receiver()
    accepted = receiver.receive(wire.decode(bout.payload), reuse=out.selection).tensor
    assert torch.equal(accepted, back.codec.decode(wire.decode(bout.payload), reuse=out.selection))
    with pytest.raises(PayloadError):
        receiver.receive(wire.decode(bout.payload), reuse=other_out.selection)
    with pytest.raises(PayloadError):
        receiver.receive(wire.decode(bout.payload))  # no forward indices remembered
    # a selection with the same positions but a different count / digest
    wrong_k = type(out.selection)(out.selection.positions, out.selection.kept_per_sample + 1, out.selection.digest)
    with pytest.raises(PayloadError):
        receiver.receive(wire.decode(bout.payload), reuse=wrong_k)
    wrong_digest = type(out.selection)(out.selection.positions, out.selection.kept_per_sample, out.selection.digest ^ 1)
    with pytest.raises(PayloadError):
        receiver.receive(wire.decode(bout.payload), reuse=wrong_digest)
    # the codec-level decode checks the same
    enc = wire.decode(bout.payload)
    with pytest.raises(PayloadError):
        TopKReuse(Cast(torch.float16)).decode(enc, reuse=other_out.selection)
    # a plain TopK decoder refuses a reused-index payload, a reused-index one a payload with indices
    with pytest.raises(PayloadError):
        TopK(0.1).decode(enc)
    with pytest.raises(PayloadError, match="^a topk/fp16 payload on a topk:reuse/fp16 link$"):
        receiver.receive(wire.decode(out.payload), reuse=out.selection)


def test_reused_index_digest_tamper_detected():
    fwd, back = parse("topk:0.2"), parse("topk:reuse")
    out = fwd.sender().send(make((3, 20)))
    bout = back.sender().send(make((3, 20)), reuse=out.selection)
    msg = parse_pb(bout.payload)
    msg.sparse.index_digest ^= 0x10
    with pytest.raises(PayloadError):
        back.receiver().receive(wire.decode(msg.SerializeToString()), reuse=out.selection)


def test_selection_of_dense_is_none():
    enc = Quantize(4).encode(make((2, 5)))
    wire.encode(enc)
    assert selection_of(enc) is None
    assert parse("quant:4").sender().send(make((2, 5))).selection is None
