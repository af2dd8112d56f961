"""swarm.compression.feedback: EF / EF21 / AQ-SGD state, mirroring, commits and retries."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _feedback_cases import DATASET, MIRRORED, PER_SAMPLE, SAMPLE_SHAPE, Link, dataset, store_error_bound
from _util import make

from protocols import PayloadError, wire
from swarm.compression import StateMismatchError, parse
from swarm.compression.state import RowFormat

# ---- 6. mirrored state ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", MIRRORED)
def test_mirrored_state_identical_after_many_steps(spec):
    link = Link(spec)
    base, drift = dataset()
    g = torch.Generator().manual_seed(3)
    everyone = list(range(DATASET))
    for t in range(40):
        if link.per_sample:
            ids = torch.randperm(DATASET, generator=g)[:4].tolist()
            x = base[ids] + 0.01 * t * drift[ids]
        else:
            ids = [0, 1, 2, 3]
            x = base[:4] + 0.01 * t * drift[:4]
        out, inc = link.step(x, ids, warmup=(t == 0))
        assert inc.tensor.shape == x.shape and inc.tensor.dtype == x.dtype
        link.assert_mirrored(x.shape, ids)
    if link.per_sample:
        link.assert_mirrored((DATASET, *SAMPLE_SHAPE), everyone)


@pytest.mark.parametrize("spec", MIRRORED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=["fp16", "bf16", "fp64"])
def test_mirrored_state_identical_other_dtypes(spec, dtype):
    link = Link(spec)
    base, drift = dataset()
    ids = [5, 1, 6]
    for t in range(12):
        x = (base[ids] + 0.02 * t * drift[ids]).to(dtype)
        _, inc = link.step(x, ids, warmup=(t == 0 and link.per_sample))
        assert inc.tensor.dtype == dtype and inc.tensor.shape == x.shape
        link.assert_mirrored(x.shape, ids)


@pytest.mark.parametrize("spec", MIRRORED)
def test_received_tensor_converges_on_slowly_changing_input(spec):
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1, 2, 3]
    errors = []
    for t in range(80):
        x = base[ids] + 0.001 * t * drift[ids]
        _, inc = link.step(x, ids)
        errors.append(float((inc.tensor - x).norm() / x.norm()))
    assert all(e == e for e in errors)
    # from the first message (a compressed cold start) to the last, the error shrinks a lot
    assert errors[-1] < 0.1 * errors[0] + 1e-6, (errors[0], errors[-1])
    assert max(errors[-10:]) < 0.05, errors[-10:]


@pytest.mark.parametrize("spec", MIRRORED)
def test_warmup_fills_buffers_with_exact_values(spec):
    link = Link(spec)
    base, _ = dataset()
    ids = [2, 4, 6]
    x = base[ids]
    out, inc = link.step(x, ids, warmup=True)
    assert torch.equal(inc.tensor, x), "warmup messages carry exact values"
    assert wire.decode(out.payload).stamp.warmup
    link.assert_mirrored(x.shape, ids)
    state, versions = link.state("receiver", x.shape, ids)
    assert all(v == 1 for v in versions)
    bound = store_error_bound(spec, x)
    assert float((state - x).abs().max()) <= float(bound), (float((state - x).abs().max()), float(bound))
    # the next message on the same input only carries the (small) store error
    _, inc2 = link.step(x, ids)
    gap = float((x - state).abs().max())
    assert float((inc2.tensor - x).abs().max()) <= gap * (1 + 1e-5) + 1e-6
    if float(bound) == 0.0:
        assert torch.equal(inc2.tensor, x)
    link.assert_mirrored(x.shape, ids)


@pytest.mark.parametrize(
    "spec",
    [
        "topk:0.1+ef21",
        "quant:4+ef21",
        "fp16+ef21",
        "topk:0.2/q8+ef21",
        "topk:0.1+ef21/sample",
        "quant:3+ef21/sample",
        "topk:0.2+aqsgd/fp32",
    ],
)
def test_state_float_store_equals_receiver_output(spec):
    """With fp32 state, the state after commit is exactly what the receiver output."""
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 3, 5, 7]
    for t in range(5):
        x = base[ids] + 0.1 * t * drift[ids]
        _, inc = link.step(x, ids)
        state, _ = link.state("receiver", x.shape, ids)
        assert torch.equal(state, inc.tensor)


@pytest.mark.parametrize("store", ["fp32", "fp16", "bf16", "q8", "q6", "q4", "q1"])
def test_aqsgd_store_readback_is_store_roundtrip(store):
    link = Link(f"topk:0.5+aqsgd/{store}")
    base, _ = dataset()
    ids = [1, 2]
    x = base[ids]
    link.step(x, ids, warmup=True)
    state, _ = link.state("sender", x.shape, ids)
    fmt = RowFormat(store, x[0].numel())
    assert torch.equal(state.reshape(2, -1), fmt.decode(fmt.encode(x.reshape(2, -1))))
    link.assert_mirrored(x.shape, ids)


def test_aqsgd_samples_are_independent():
    link = Link("quant:4+aqsgd/fp32")
    base, _ = dataset()
    link.step(base[[0, 1]], [0, 1], warmup=True)
    before, _ = link.state("receiver", (1, *SAMPLE_SHAPE), [0])
    link.step(base[[1, 2]] * 3, [1, 2])  # touches samples 1 and 2 only
    after, versions = link.state("receiver", (1, *SAMPLE_SHAPE), [0])
    assert torch.equal(before, after)
    _, v = link.state("receiver", (3, *SAMPLE_SHAPE), [0, 1, 2])
    assert v == (1, 2, 1)
    link.assert_mirrored((3, *SAMPLE_SHAPE), [0, 1, 2])


def test_per_sample_needs_valid_ids():
    link = Link("topk:0.2+aqsgd")
    x = make((3, 4))
    with pytest.raises(ValueError):
        link.sender.send(x)
    with pytest.raises(ValueError):
        link.sender.send(x, sample_ids=[1, 2])
    with pytest.raises(ValueError):
        link.sender.send(x, sample_ids=[1, 1, 2])
    out = link.sender.send(x, sample_ids=torch.tensor([4, 5, 6]))
    assert link.receiver.receive(wire.decode(out.payload), sample_ids=torch.tensor([4, 5, 6])).tensor.shape == x.shape


@pytest.mark.parametrize("spec", MIRRORED)
def test_mirrored_empty_batches(spec):
    """An empty micro-batch (no samples, or samples with no elements) goes through and commits."""
    for shape in [(0, 5), (3, 0)]:
        link = Link(spec)
        x = torch.zeros(shape)
        ids = list(range(shape[0]))
        for warmup in (True, False):
            out, inc = link.step(x, ids, warmup=warmup)
            assert inc.tensor.shape == x.shape
        link.assert_mirrored(shape, ids)


@pytest.mark.parametrize("spec", PER_SAMPLE)
def test_per_sample_batch_of_one(spec):
    """Micro-batches of a single sample (and batches where only one sample has state yet)."""
    link = Link(spec)
    base, drift = dataset()
    for t in range(3):
        for i in (0, 1):
            x = base[[i]] + 0.1 * t * drift[[i]]
            link.step(x, [i], warmup=(t == 0))
            link.assert_mirrored(x.shape, [i])
    x = base[[1, 2]]
    link.step(x, [1, 2])
    link.assert_mirrored(x.shape, [1, 2])


def test_stamp_carries_versions():
    link = Link("topk:0.2+aqsgd")
    base, _ = dataset()
    link.step(base[[0, 1, 3]], [0, 1, 3], warmup=True)
    link.step(base[[0, 3]], [0, 3])
    out = link.sender.send(base[[1, 2, 0]], sample_ids=[1, 2, 0])
    assert wire.decode(out.payload).stamp.sample_versions == (1, 0, 2)
    g = Link("topk:0.2+ef21")
    for _ in range(3):
        g.step(base[:2], [0, 1])
    assert wire.decode(g.sender.send(base[:2]).payload).stamp.version == 3


def test_mirrored_receiver_rejects_unstamped_payload():
    """A payload without state versions is refused as a bad payload (what a stage answers a sender
    with), its state untouched, and the link goes on with the next stamped message."""
    link = Link("topk:0.2+ef21")
    x = make((2, 10))
    plain = parse("topk:0.2").sender().send(x).payload
    with pytest.raises(PayloadError, match="carries no state version") as info:
        link.receiver.receive(wire.decode(plain))
    assert isinstance(info.value, StateMismatchError)
    assert link.state("receiver", x.shape, [0, 1])[1] == (0,)
    _, inc = link.step(x, [0, 1])
    assert link.state("receiver", x.shape, [0, 1])[1] == (1,)
    link.assert_mirrored(x.shape, [0, 1])
    assert torch.equal(link.state("receiver", x.shape, [0, 1])[0], inc.tensor)


def test_mirrored_receiver_takes_exact_values_in_warmup_and_its_codecs_otherwise():
    """A warmup stamp with compressed values, or exact values sent as a compressed difference, would
    leave the two ends' state apart: refused, the receiver's state untouched."""
    link = Link("topk:0.2+ef21")
    x = make((2, 10))
    compressed = wire.decode(link.sender.send(x).payload)
    compressed.stamp = replace(compressed.stamp, warmup=True)
    with pytest.raises(PayloadError, match="^a warmup payload of topk/fp32 values, not exact ones$"):
        link.receiver.receive(compressed)
    exact = wire.decode(link.sender.send(x, warmup=True).payload)
    exact.stamp = replace(exact.stamp, warmup=False)
    with pytest.raises(PayloadError, match="^a fp32 payload on a topk:0.2 link$"):
        link.receiver.receive(exact)
    assert link.state("receiver", x.shape, [0, 1])[1] == (0,)
    link.step(x, [0, 1], warmup=True)
    link.assert_mirrored(x.shape, [0, 1])


# ---- in-place use of tensors between send/receive and commit -----------------------------------------


@pytest.mark.parametrize("spec", ["topk:0.5+ef21", "quant:4+ef21", "topk:0.5+aqsgd/fp32", "topk:0.5+aqsgd"])
def test_receiver_state_independent_of_output_mutation(spec):
    """The consumer may modify the received activation in place (e.g. an in-place ReLU) before it
    commits; the mirrored state must still be what the sender computed."""
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1, 2]
    for t in range(3):
        x = base[ids] + 0.1 * t * drift[ids]
        out = link.sender.send(x, sample_ids=ids, warmup=(t == 0))
        inc = link.receiver.receive(wire.decode(out.payload), sample_ids=ids)
        inc.tensor.relu_()
        out.commit()
        inc.commit()
        link.assert_mirrored(x.shape, ids)


@pytest.mark.parametrize("spec", ["topk:0.5+ef21", "topk:0.5+aqsgd/fp32", "quant:4+aqsgd"])
def test_sender_state_independent_of_input_mutation(spec):
    """The caller may reuse its input buffer after send() and before the delivery is confirmed."""
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1, 2]
    for t in range(3):
        x = (base[ids] + 0.1 * t * drift[ids]).clone()
        out = link.sender.send(x, sample_ids=ids, warmup=(t == 0))
        inc = link.receiver.receive(wire.decode(out.payload), sample_ids=ids)
        x.mul_(-2.0)
        out.commit()
        inc.commit()
        link.assert_mirrored(x.shape, ids)


# ---- EF (sender-only) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "topk:0.1+ef",
        "quant:2+ef",
        "topk:0.2+ef/sample",
        "topk:0.2+efmixed",
        "topk:0.3/q4+efmixed/sample",
        "quant:3/tensor+ef/sample",
        "lowrank:2+ef",
        "lowrank:2/q8+ef/sample",
        "lowrank:2/warm+ef",
        "subspace:2/every3+ef",
        "subspace:2/q8/every4+ef/sample",  # a held basis never sends what lies outside it: EF needs refreshes
    ],
)
def test_error_feedback_telescopes(spec):
    """EF: the sum of what was received equals the sum of inputs minus the final error."""
    parsed = parse(spec)
    sender, receiver = parsed.sender(), parsed.receiver()
    base, drift = dataset()
    ids = [3, 1, 4, 0]
    keys = ids if parsed.per_sample else None
    total_x = torch.zeros((4, *SAMPLE_SHAPE), dtype=torch.float64)
    total_y = torch.zeros_like(total_x)
    for t in range(30):
        x = base[ids] + 0.05 * t * drift[ids]
        out = sender.send(x, sample_ids=ids)
        inc = receiver.receive(wire.decode(out.payload), sample_ids=ids)
        y = inc.tensor
        out.commit()
        inc.commit()  # a subspace receiver installs and counts its basis on commit, as the sender
        total_x += x.double()
        total_y += y.double()
    error, versions = sender.table.load((4, *SAMPLE_SHAPE), keys, "cpu")
    assert set(versions) == {30}
    assert float((total_y + error.double() - total_x).abs().max()) < 1e-3
    # the error does not grow with the number of steps
    assert float(error.abs().max()) < 30 * float(base.abs().max())
    assert float(error.norm()) < float(total_x.norm()) / 3


def test_efmixed_keeps_exactly_k_and_reaches_error_positions():
    parsed = parse("topk:0.2+efmixed")
    sender = parsed.sender()
    x = make((2, 20))
    sender.send(x).commit()
    out = sender.send(x)
    enc = wire.decode(out.payload)
    assert enc.body.kept_per_sample == 4
    assert torch.bincount(enc.body.positions // 20, minlength=2).tolist() == [4, 4]


@pytest.mark.parametrize("spec", ["topk:0.2+ef", "quant:2+ef/sample", "topk:0.2+efmixed"])
def test_ef_warmup_sends_exact_and_clears_error(spec):
    parsed = parse(spec)
    sender, receiver = parsed.sender(), parsed.receiver()
    ids = [0, 1]
    keys = ids if parsed.per_sample else None
    sender.send(make((2, 20)), sample_ids=ids).commit()
    err, _ = sender.table.load((2, 20), keys, "cpu")
    assert float(err.abs().max()) > 0
    x = make((2, 20))
    out = sender.send(x, sample_ids=ids, warmup=True)
    assert torch.equal(receiver.receive(wire.decode(out.payload), sample_ids=ids).tensor, x)
    out.commit()
    err, _ = sender.table.load((2, 20), keys, "cpu")
    assert float(err.abs().max()) == 0.0
