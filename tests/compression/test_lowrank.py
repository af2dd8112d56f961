"""swarm.compression.lowrank: accuracy, determinism, size and edge cases of lowrank:R."""

from __future__ import annotations

import pytest
import torch
from _util import DTYPE_IDS, FLOAT_DTYPES

from protocols import wire
from swarm.compression import parse
from swarm.compression.lowrank import LowRank, _sketch


def rank_r(shape: tuple[int, ...], r: int, seed: int = 0) -> torch.Tensor:
    """A tensor whose [rows, last dim] matrix has rank exactly r, singular values spread over 10x."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = int(torch.tensor(shape[:-1]).prod()), shape[-1]
    u = torch.linalg.qr(torch.randn(rows, r, generator=g)).Q
    v = torch.linalg.qr(torch.randn(cols, r, generator=g)).Q
    s = torch.logspace(1, 0, r) * 3
    return ((u * s) @ v.T).reshape(shape)


def through(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    parsed = parse(spec)
    payload = parsed.sender().send(x).payload
    return parsed.receiver().receive(wire.decode(payload)).tensor, payload


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / x.double().norm())


@pytest.mark.parametrize(
    ("spec", "bound"),
    [("lowrank:8", 2e-3), ("lowrank:8/bf16", 1.5e-2), ("lowrank:8/fp32", 1e-5), ("lowrank:8/q8", 3e-2)],
)
@pytest.mark.parametrize("shape", [(4, 64, 48), (300, 40), (2, 3, 16, 24)])
def test_an_exactly_rank_r_tensor_comes_back(spec, bound, shape):
    x = rank_r(shape, 8)
    y, _ = through(spec, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(x, y) < bound


def test_error_close_to_the_best_rank_r_approximation():
    """On a decaying spectrum (no exact low rank) the power iterations get within a few percent of
    the truncated SVD's error, the best any rank-8 message can do."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(512, 96, generator=g) @ torch.diag(torch.logspace(0, -3, 96)) @ torch.randn(96, 96, generator=g)
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    best = (u[:, :8] * s[:8]) @ vh[:8]
    y, _ = through("lowrank:8/fp32", m)
    assert rel_error(m, y) < 1.05 * rel_error(m, best)


def test_the_same_input_gives_the_same_bytes():
    x = torch.randn(8, 64, 32)
    first = parse("lowrank:4").sender().send(x).payload
    assert parse("lowrank:4").sender().send(x.clone()).payload == first
    _sketch.cache_clear()  # the fixed start is drawn again from its seed: still the same
    assert parse("lowrank:4").sender().send(x).payload == first
    assert parse("lowrank:4").sender().send(x + 1e-3).payload != first


@pytest.mark.parametrize(("spec", "factor_bits"), [("lowrank:8", 16), ("lowrank:8/q8", 8), ("lowrank:8/fp32", 32)])
def test_payload_is_the_two_factors(spec, factor_bits):
    """bits per element ~ factor_bits * R * (rows + cols) / (rows * cols), plus a small header."""
    x = torch.randn(4, 256, 192)
    _, payload = through(spec, x)
    rows, cols = 4 * 256, 192
    factors = factor_bits * 8 * (rows + cols) / 8
    ranges = 2 * 8 * 8 if "q" in spec else 0  # a (low, step) float32 pair per component and factor
    assert factors + ranges <= len(payload) <= factors + ranges + 64
    assert len(payload) < x.numel() * factor_bits / 8 / 10  # over 10x smaller than the tensor in that format


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_input_dtypes_computed_in_float32(dtype):
    x = rank_r((6, 32, 24), 4).to(dtype)
    y, _ = through("lowrank:4", x)
    assert y.dtype == dtype
    assert rel_error(x.float(), y.float()) < {torch.bfloat16: 2e-2}.get(dtype, 3e-3)


def test_rank_above_the_matrix_is_exact_up_to_the_factor_format():
    x = torch.randn(5, 3)
    y, payload = through("lowrank:64/fp32", x)
    assert wire.decode(payload).body.rank == 3
    assert rel_error(x, y) < 1e-5


@pytest.mark.parametrize("shape", [(), (1,), (7,), (1, 1), (0, 5), (3, 0), (2, 0, 4)])
def test_tiny_and_empty_tensors(shape):
    x = torch.randn(shape)
    y, _ = through("lowrank:2", x)
    assert y.shape == x.shape
    if x.numel() and min(x.reshape(-1, x.shape[-1] if x.dim() else 1).shape) <= 2:
        assert rel_error(x, y) < 1e-3  # rank 1 or 2 holds such a matrix whole


def test_all_zero_input_decodes_to_zeros():
    y, _ = through("lowrank:4/q8", torch.zeros(16, 32))
    assert torch.equal(y, torch.zeros(16, 32))


def test_fp16_input_near_its_limit_saturates_instead_of_overflowing():
    x = torch.full((8, 8), 65000.0, dtype=torch.float16)
    x[0, 0] = -65000.0
    y, _ = through("lowrank:1", x)
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused(bad):
    x = torch.randn(4, 4)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        parse("lowrank:2").sender().send(x)


def test_codec_parameters_are_checked():
    with pytest.raises(ValueError):
        LowRank(0)
    with pytest.raises(ValueError, match="stochastic"):
        LowRank(4, parse("quant:8/stochastic").codec)
    assert LowRank(4).spec == "lowrank:4" and parse("lowrank:4/q6").codec.spec == "lowrank:4/q6"


@pytest.mark.parametrize(
    "spec", ["lowrank:2+ef", "lowrank:2+ef21", "lowrank:2/q8+ef21", "lowrank:2/warm+ef", "lowrank:2/q8/warm+ef21"]
)
def test_error_feedback_sends_a_full_rank_tensor_in_rank_2_pieces(spec):
    """The same full-rank tensor sent again and again: EF21's receiver output converges to it (each
    message sends the top of what is left), EF's running mean of outputs does (the error is carried)."""
    x = torch.randn(4, 12, 10, generator=torch.Generator().manual_seed(2))
    parsed = parse(spec)
    sender, receiver = parsed.sender(), parsed.receiver()
    total = torch.zeros_like(x)
    errors = []
    for t in range(1, 41):
        out = sender.send(x)
        inc = receiver.receive(wire.decode(out.payload))
        out.commit()
        inc.commit()
        y = inc.tensor
        total += y
        errors.append(rel_error(x, y if parsed.mirrored else total / t))
    assert errors[0] > 0.3  # one rank-2 message of a 48 x 10 random matrix misses most of it
    assert errors[-1] < 0.1 * errors[0], errors[::8]


def test_decoding_gives_the_same_floats_at_any_thread_count():
    """Both ends of an EF21 link add the decoded message to their state: peers running different
    torch thread counts must still agree bit for bit (encoding need not: one end encodes)."""
    payload = wire.decode(parse("lowrank:16").sender().send(rank_r((4, 128, 96), 16) + torch.randn(4, 128, 96)).payload)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outputs.append(LowRank(16).decode(payload))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])
