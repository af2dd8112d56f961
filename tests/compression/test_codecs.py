"""swarm.compression codecs: round trips and error bounds (TopK, sizes, reuse: test_topk.py)."""

from __future__ import annotations

import pytest
import torch
from _codec_cases import CODECS, SHAPES, G, group_view, shape_id, through_wire
from _util import DTYPE_IDS, FLOAT_DTYPES, make

from protocols import PayloadError, wire
from swarm.compression import Cast, Quantize, TopK, TopKReuse, parse
from swarm.compression.codecs import selection_of

# ---- 1. round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(CODECS))
def test_roundtrip_through_bytes(name, dtype, case):
    codec = CODECS[name]
    shape, layout = case
    x = make(shape, dtype, layout)
    before = x.clone()
    enc = codec.encode(x)
    in_memory = codec.decode(enc)
    payload = wire.encode(enc)
    assert isinstance(payload, bytes)
    decoded = wire.decode(payload)
    assert decoded.shape == tuple(shape)
    assert decoded.dtype == dtype
    out = codec.decode(decoded)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert torch.equal(out, in_memory)
    assert torch.equal(x, before), "encode must not modify its input"
    assert bool(torch.isfinite(out.float()).all())

    # What the values must be, for the codecs that have an exact answer.
    if isinstance(codec, Cast) and codec.wire_dtype in (None, dtype):
        assert torch.equal(out, x)
    elif isinstance(codec, Cast):
        assert torch.equal(out, x.to(codec.wire_dtype).to(dtype))
    elif isinstance(codec, TopK) and codec.ratio == 1.0 and codec.inner == Cast():
        assert torch.equal(out, x)
    elif isinstance(codec, TopK) and isinstance(codec.inner, Cast):
        # kept values are exact (up to the value cast), the rest are zero
        wire_dtype = codec.inner.wire_dtype or dtype
        expected = x.to(wire_dtype).to(dtype)
        kept = out != 0
        assert torch.equal(out[kept], expected[kept])


@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("inner", ["fp16", "q6", "none"])
def test_reuse_roundtrip_through_bytes(inner, dtype, case):
    shape, layout = case
    x = make(shape, dtype, layout)
    grad = make(shape, dtype, layout)
    value_codec = {"fp16": Cast(torch.float16), "q6": Quantize(6, G.SAMPLE), "none": Cast()}[inner]
    fwd = TopK(0.3, Cast(torch.float16))
    fwd_enc = fwd.encode(x)
    wire.encode(fwd_enc)  # fills the digest of the index bytes
    sel = selection_of(fwd_enc)
    assert sel is not None
    back = TopKReuse(value_codec)
    enc = back.encode(grad, reuse=sel)
    in_memory = back.decode(enc, reuse=sel)
    out = back.decode(through_wire(enc), reuse=sel)
    assert out.shape == grad.shape and out.dtype == grad.dtype
    assert torch.equal(out, in_memory)
    mask = torch.zeros(grad.numel(), dtype=torch.bool)
    mask[sel.positions] = True
    mask = mask.view(grad.shape)
    assert bool((out[~mask] == 0).all())
    if inner == "none":
        assert torch.equal(out, torch.where(mask, grad, torch.zeros_like(grad)))


@pytest.mark.parametrize(
    "spec",
    [
        "none",
        "fp16",
        "bf16",
        "quant:3",
        "quant:4/tensor",
        "quant:8/channel",
        "topk:0.1",
        "topk:0.2/q4",
        "topk:0.5/bf16",
        "lowrank:2",
        "lowrank:2/q8",
    ],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_sender_receiver_roundtrip(spec, dtype):
    parsed = parse(spec)
    sender, receiver = parsed.sender(), parsed.receiver()
    x = make((3, 4, 5), dtype, "transposed")
    out = sender.send(x)
    inc = receiver.receive(wire.decode(out.payload))
    expected = parsed.codec.decode(wire.decode(out.payload))
    assert inc.tensor.dtype == dtype and inc.tensor.shape == x.shape
    assert torch.equal(inc.tensor, expected)
    # committing a stateless link is allowed and moves no state: the same input, the same bytes
    out.commit()
    inc.commit()
    again = sender.send(x)
    assert again.payload == out.payload
    assert torch.equal(receiver.receive(wire.decode(again.payload)).tensor, inc.tensor)
    assert sender.state_bytes == receiver.state_bytes == 0


def test_decode_to_device_cpu():
    x = make((3, 8))
    for codec in CODECS.values():
        enc = through_wire(codec.encode(x))
        out = codec.decode(enc, device="cpu")
        assert out.device.type == "cpu"
        assert torch.equal(out, codec.decode(enc)), codec


def test_codec_rejects_payload_of_wrong_kind():
    x = make((3, 8))
    sparse = through_wire(TopK(0.5).encode(x))
    dense = through_wire(Quantize(4).encode(x))
    with pytest.raises(PayloadError):
        Cast().decode(sparse)
    with pytest.raises(PayloadError):
        Quantize(4).decode(sparse)
    with pytest.raises(PayloadError):
        TopK(0.5).decode(dense)


# Which payloads a plain receiver takes on a link of each codec, besides exact ones (any link): its
# own codec's, where `none` (as it is, in any dtype: error feedback sends fp32 sums of bf16 tensors)
# and TopK values kept as they are take raw values in any dtype.
LINK_TAKES = {
    "none": {"none", "fp16", "bf16"},
    "fp16": {"fp16"},
    "bf16": {"bf16"},
    "quant:4": {"quant:4"},
    "quant:2": {"quant:2"},
    "quant:4/tensor": {"quant:4/tensor"},
    "topk:0.5": {"topk:0.5", "topk:0.2", "topk:0.5/fp16"},
    "topk:0.2": {"topk:0.5", "topk:0.2", "topk:0.5/fp16"},
    "topk:0.5/fp16": {"topk:0.5/fp16"},
    "topk:0.5/q4": {"topk:0.5/q4"},
    "topk:0.5/q8": {"topk:0.5/q8"},
    "lowrank:2": {"lowrank:2"},
    "lowrank:2/q8": {"lowrank:2/q8"},
    "lowrank:4": {"lowrank:4"},
}


@pytest.mark.parametrize("link", LINK_TAKES)
@pytest.mark.parametrize("sent", LINK_TAKES)
def test_receiver_takes_its_codecs_payloads_and_exact_ones_only(link, sent):
    x = make((3, 8))
    receiver = parse(link).receiver()
    payload = wire.decode(parse(sent).sender().send(x).payload)
    exact = wire.decode(parse(sent).sender().send(x, warmup=True).payload)
    assert torch.equal(receiver.receive(exact).tensor, x)
    assert torch.equal(receiver.receive_stateless(exact).tensor, x)
    if sent in LINK_TAKES[link] or sent == "none":  # none sends fp32 tensors exactly
        assert torch.equal(receiver.receive(payload).tensor, parse(sent).codec.decode(payload))
        return
    for receive in (receiver.receive, receiver.receive_stateless):
        with pytest.raises(PayloadError) as refused:
            receive(payload)
        assert str(refused.value).endswith(f"payload on a {parse(link).codec.spec} link"), refused.value
        assert "\n" not in str(refused.value)


def test_refusals_name_the_payload_in_spec_words():
    x = make((3, 8))
    cases = {
        ("quant:4", "topk:0.1"): "a quant:4/sample payload on a topk:0.1 link",
        ("topk:0.1/q8", "quant:8"): "a topk/q8 payload on a quant:8/sample link",
        ("fp16", "bf16"): "a fp16 payload on a bf16 link",
        ("topk:0.5/fp16", "topk:0.5/q8"): "a topk/fp16 payload on a topk:0.5/q8 link",
        ("lowrank:2", "lowrank:3"): "a lowrank:2/fp16 payload on a lowrank:3 link",
        ("lowrank:2/q8", "lowrank:2"): "a lowrank:2/q8 payload on a lowrank:2 link",
        ("lowrank:2", "quant:8"): "a lowrank:2/fp16 payload on a quant:8/sample link",
        ("fp16", "lowrank:2/bf16"): "a fp16 payload on a lowrank:2/bf16 link",
    }
    for (sent, link), message in cases.items():
        with pytest.raises(PayloadError, match=f"^{message}$"):
            parse(link).codec.decode(wire.decode(parse(sent).sender().send(x).payload))


def test_codec_parameter_validation():
    for bits in (0, 9, -1):
        with pytest.raises(ValueError):
            Quantize(bits)
    for ratio in (0.0, -0.1, 1.01, 2.0):
        with pytest.raises(ValueError):
            TopK(ratio)
    with pytest.raises(ValueError):
        TopKReuse().encode(make((2, 4)))


# ---- 2. error bounds ---------------------------------------------------------------------------


def _tolerance(xg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float slack per group: fp32 arithmetic on (low, step), plus the rounding to the output dtype."""
    amax = xg.abs().amax(dim=1)
    slack = 8 * torch.finfo(torch.float32).eps * amax
    if dtype in (torch.float16, torch.bfloat16):
        slack = slack + torch.finfo(dtype).eps * amax
    return slack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_round_to_nearest_error_bound(bits, granularity, dtype):
    shape = (3, 4, 5, 6)
    # Groups with very different ranges and offsets.
    scale = torch.logspace(-2, 2, 12, dtype=torch.float64).view(3, 4, 1, 1)
    offset = torch.linspace(-50, 50, 12, dtype=torch.float64).view(3, 4, 1, 1)
    x = (torch.randn(shape, dtype=torch.float64) * scale + offset).to(dtype)
    codec = Quantize(bits, granularity)
    out = codec.decode(through_wire(codec.encode(x)))
    xg = group_view(x.to(torch.float64), granularity)
    yg = group_view(out.to(torch.float64), granularity)
    lo, hi = xg.amin(dim=1), xg.amax(dim=1)
    bound = (hi - lo) / ((1 << bits) - 1) / 2
    err = (yg - xg).abs().amax(dim=1)
    assert bool((err <= bound * (1 + 1e-6) + _tolerance(xg, dtype)).all()), (err / bound).max()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_quantization_is_monotone(bits, dtype):
    """Round-to-nearest min-max quantization preserves order: x_i <= x_j implies y_i <= y_j.

    Uses narrow ranges far from zero, where the float32 (low, step) of the wire are coarse
    compared to the input's own precision (matters for fp64 input).
    """
    for offset, width in [(1.0, 1e-6), (1.0 - 2.9e-8, 1e-6), (1000.0, 1e-3), (-3.0, 5e-7), (0.0, 1.0)]:
        x = (offset + torch.linspace(0, width, 64, dtype=torch.float64)).to(dtype)
        codec = Quantize(bits, G.TENSOR)
        enc = codec.encode(x)
        codes = enc.body.codes.long()
        assert bool((codes.diff() >= 0).all()), (offset, width, codes.tolist())
        y = codec.decode(through_wire(enc)).to(torch.float64)
        assert bool((y.diff() >= 0).all()), (offset, width)
        # and the error stays within one float32 step of the data, not a fraction of the range
        bound = (float(x.double().max()) - float(x.double().min())) / ((1 << bits) - 1) / 2
        slack = 8 * torch.finfo(torch.float32).eps * float(x.double().abs().max())
        if dtype in (torch.float16, torch.bfloat16):
            slack += torch.finfo(dtype).eps * float(x.double().abs().max())
        assert float((y - x.double()).abs().max()) <= bound * (1 + 1e-6) + slack, (offset, width)


def test_fp64_quantization_error_bound_narrow_range():
    """fp64 input whose minimum is not a float32 number: codes must not wrap around."""
    x = torch.tensor([1 - 2.9e-8, 1 + 5e-7, 1 + 1e-6], dtype=torch.float64)
    codec = Quantize(8, G.TENSOR)
    enc = codec.encode(x)
    y = codec.decode(through_wire(enc))
    bound = (1e-6 + 2.9e-8) / 255 / 2
    slack = 8 * torch.finfo(torch.float32).eps
    assert float((y - x).abs().max()) <= bound + slack, (enc.body.codes.tolist(), (y - x).tolist())


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("value", [0.0, 1.5, -3.25, 1234.5, 2.0**-20, -65504.0])
def test_constant_tensor_decodes_exactly(granularity, dtype, value):
    for bits in (1, 4, 8):
        for stochastic in (False, True):
            x = torch.full((3, 4, 5), value, dtype=dtype)
            codec = Quantize(bits, granularity, stochastic)
            enc = codec.encode(x)
            assert bool(torch.isfinite(enc.body.steps).all())
            out = codec.decode(through_wire(enc))
            assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_constant_rows_exact_next_to_varying_rows(dtype):
    x = make((4, 16), dtype)
    x[1] = 2.5
    x[3] = 0.0
    codec = Quantize(3, G.SAMPLE)
    out = codec.decode(through_wire(codec.encode(x)))
    assert torch.equal(out[1], x[1])
    assert torch.equal(out[3], x[3])


def test_quantize_extreme_but_finite_range():
    """Finite float32 values whose range overflows float32 (max - min > 3.4e38)."""
    x = torch.tensor([[-3.0e38, 0.0, 1.0, 3.0e38]])
    codec = Quantize(8, G.SAMPLE)
    try:
        enc = codec.encode(x)
    except ValueError:
        return  # refusing the tensor is acceptable; producing an unusable payload is not
    out = codec.decode(through_wire(enc))
    assert bool(torch.isfinite(out).all())
    bound = 6.0e38 / 255 / 2
    assert float((out.double() - x.double()).abs().max()) <= bound * 1.01


def test_quantize_rejects_non_finite():
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = make((2, 5))
        x[1, 2] = bad
        with pytest.raises(ValueError):
            Quantize(4).encode(x)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_unbiased_and_within_one_step(bits):
    torch.manual_seed(1)
    x = make((3, 20)) * torch.tensor([[0.1], [1.0], [10.0]])
    codec = Quantize(bits, G.SAMPLE, stochastic=True)
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    step = (hi - lo) / ((1 << bits) - 1)
    total = torch.zeros_like(x, dtype=torch.float64)
    runs = 400
    distinct = set()
    for _ in range(runs):
        enc = codec.encode(x)
        y = codec.decode(through_wire(enc))
        distinct.add(bytes(enc.body.codes.tolist()))
        assert bool(((y - x).abs() <= step * (1 + 1e-5) + 1e-5).all())
        total += y.double()
    mean = (total / runs).float()
    # std of the mean is at most step / (2 sqrt(runs)) = step / 40; allow 8 of those
    assert bool(((mean - x).abs() <= step * 0.2).all()), float(((mean - x).abs() / step).max())
    assert len(distinct) > 1, "stochastic rounding gave the same codes every time"
    # and it really is less biased than round-to-nearest on this data
    rtn = Quantize(bits, G.SAMPLE).decode(Quantize(bits, G.SAMPLE).encode(x))
    assert float((mean - x).abs().mean()) < float((rtn - x).abs().mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=DTYPE_IDS.get)
def test_fp16_cast_saturates(dtype):
    x = torch.tensor([[1e5, -1e6, 65504.0, 70000.0, 3.0, -65520.0]], dtype=torch.float64).to(dtype)
    for codec in (Cast(torch.float16), TopK(1.0, Cast(torch.float16)), TopK(0.5, Cast(torch.float16))):
        out = codec.decode(through_wire(codec.encode(x)))
        assert bool(torch.isfinite(out).all()), codec
        # the largest fp16 value, as the output dtype holds it (bf16 rounds 65504 to 65536)
        limit = float(torch.tensor(65504.0).to(dtype))
        assert float(out.abs().max()) <= limit
        kept = out != 0
        ref = x.double().clamp(-65504, 65504).to(torch.float16).to(dtype)
        assert torch.equal(out[kept], ref[kept])
    out = Cast(torch.float16).decode(through_wire(Cast(torch.float16).encode(x)))
    limit = float(torch.tensor(65504.0).to(dtype))
    assert out[0, 0] == limit and out[0, 1] == -limit
