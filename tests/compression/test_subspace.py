"""swarm.compression.subspace and .basis: subspace:R's accuracy, size, basis schedule, and its
mirrored basis (bit-identical ends, versions, commit on delivery, reset, checkpoints)."""

from __future__ import annotations

import io

import pytest
import torch
from test_lowrank import rank_r, rel_error

from protocols import PayloadError, wire
from swarm.compression import StaleStateError, StateMismatchError, parse
from swarm.compression.spec import keeps_state


class Link:
    """Both ends of one subspace link direction."""

    def __init__(self, spec: str) -> None:
        self.spec = parse(spec)
        self.sender, self.receiver = self.spec.sender(), self.spec.receiver()

    def step(self, x, commit=True):
        out = self.sender.send(x)
        enc = wire.decode(out.payload)
        inc = self.receiver.receive(enc)
        if commit:
            out.commit()
            inc.commit()
        return out, enc, inc


def drifting(t: int, shape=(4, 64, 48), r: int = 6) -> torch.Tensor:
    """Activations whose rank-r row space turns slowly with t, plus a little noise."""
    g = torch.Generator().manual_seed(100 + t)
    base = rank_r(shape, r, seed=0)
    return base + 0.02 * t * rank_r(shape, r, seed=1) + 1e-3 * torch.randn(shape, generator=g)


def bases(end) -> dict:
    return end.codec.link_state.state_dict()


def assert_same_bases(a, b):
    sa, sb = bases(a), bases(b)
    assert len(sa["bases"]) == len(sb["bases"]) > 0
    for x, y in zip(sa["bases"], sb["bases"], strict=True):
        assert (x["cols"], x["version"], x["sent"]) == (y["cols"], y["version"], y["sent"])
        assert torch.equal(x["vectors"], y["vectors"])  # bit for bit, not close


@pytest.mark.parametrize(
    ("spec", "bound"),
    [("subspace:8", 3e-3), ("subspace:8/bf16", 2e-2), ("subspace:8/fp32", 1e-3), ("subspace:8/q8", 3e-2)],
)
def test_low_rank_data_comes_back_through_a_held_basis(spec, bound):
    link = Link(spec)
    x = rank_r((4, 64, 48), 8)
    _, first, _ = link.step(x)
    _, second, inc = link.step(x + 0.0)
    assert first.body.basis is not None and second.body.basis is None  # the second rides the held basis
    assert inc.tensor.shape == x.shape and inc.tensor.dtype == x.dtype
    assert rel_error(x, inc.tensor) < bound


def test_error_on_drifting_activations_stays_near_a_fresh_low_rank():
    """Within a basis' messages the row space drifts: the error grows a little, then a refresh
    brings it back to what lowrank gets with a fresh factorization of the same rank."""
    link = Link("subspace:6/fp32/every8")
    errors = [rel_error(x, link.step(x)[2].tensor) for x in map(drifting, range(16))]
    fresh = parse("lowrank:6/fp32")
    lowrank = rel_error(drifting(8), fresh.codec.decode(fresh.codec.encode(drifting(8))))
    assert errors[8] < 2 * lowrank + 1e-3  # a refresh message: its own basis
    assert max(errors) < 0.2
    assert errors[7] > errors[8]  # the held basis had aged


def test_a_message_costs_rank_over_cols_of_the_tensor():
    link = Link("subspace:8")
    x = torch.randn(8, 128, 256)
    rows, cols = 8 * 128, 256
    refresh, normal = link.step(x)[0].payload, link.step(x)[0].payload
    assert 8 * rows * 2 < len(normal) < 8 * rows * 2 + 64  # fp16 coefficients and a header
    assert len(refresh) - len(normal) == pytest.approx(8 * cols * 2, abs=16)  # plus the fp16 basis
    lowrank = parse("lowrank:8").sender().send(x).payload
    assert len(normal) < len(lowrank) - 8 * cols * 2 + 64  # lowrank pays the right factor every time
    q8 = Link("subspace:8/q8")
    q8.step(x)
    assert len(q8.step(x)[0].payload) < 0.55 * len(normal)
    # bits per element: about 16 R / cols
    assert 8 * len(normal) / x.numel() == pytest.approx(16 * 8 / cols, rel=0.02)


@pytest.mark.parametrize("every", [1, 3, 32])
def test_a_fresh_basis_every_k_delivered_messages(every):
    link = Link(f"subspace:4/every{every}")
    carried = []
    for t in range(2 * every + 2):
        _, enc, _ = link.step(drifting(t))
        carried.append(enc.body.basis is not None)
        assert enc.body.basis_version == t // every + 1
    assert carried == [t % every == 0 for t in range(2 * every + 2)]


def test_undelivered_messages_do_not_count_toward_a_refresh():
    link = Link("subspace:4/every2")
    link.step(drifting(0))
    for _ in range(3):  # failed attempts of the second message: never committed
        _, enc, _ = link.step(drifting(1), commit=False)
        assert enc.body.basis is None and enc.body.basis_version == 1
    _, enc, _ = link.step(drifting(1))
    assert enc.body.basis is None
    _, enc, _ = link.step(drifting(2))
    assert enc.body.basis is not None and enc.body.basis_version == 2


def test_a_small_first_micro_batch_leaves_room_for_a_fuller_basis():
    link = Link("subspace:8")
    _, enc, _ = link.step(torch.randn(3, 32))  # rank 3 at most
    assert enc.body.rank == 3
    _, enc, _ = link.step(torch.randn(40, 32))  # could fill rank 8: refreshed
    assert (enc.body.rank, enc.body.basis_version, enc.body.basis is not None) == (8, 2, True)
    x = torch.randn(2, 32)  # a small one rides the rank-8 basis: coefficients for 2 rows
    _, enc, inc = link.step(x)
    assert (enc.body.rank, enc.body.basis) == (8, None)
    assert inc.tensor.shape == (2, 32)


def test_both_ends_hold_bit_identical_bases_after_refreshes():
    link = Link("subspace:5/q6/every3")
    for t in range(9):
        _, enc, _ = link.step(drifting(t, shape=(4, 30, 40)))
        assert_same_bases(link.sender, link.receiver)
    # the held basis is the one decoded from the message's bytes, not the range finder's floats
    _, enc, _ = link.step(drifting(9, shape=(4, 30, 40)))
    assert enc.body.basis is not None
    held = bases(link.receiver)["bases"][0]["vectors"]
    assert torch.equal(held, enc.body.basis.data.float().view(5, 40))


def test_ef_on_a_subspace_link():
    link = Link("subspace:2/every4+ef")
    for t in range(6):
        link.step(drifting(t, shape=(4, 10, 12)))
    assert_same_bases(link.sender, link.receiver)
    assert link.sender.state_bytes == link.receiver.state_bytes + 4 * 10 * 12 * 4  # the sender's EF buffer too


def test_a_delivery_commits_once_and_a_stale_one_not_at_all():
    link = Link("subspace:4/every8")
    link.step(drifting(0))
    out, _, inc = link.step(drifting(1), commit=False)
    retry, _, retry_in = link.step(drifting(1), commit=False)
    assert retry.payload == out.payload  # the retry is encoded against the same basis
    out.commit()
    out.commit()  # a second commit of one delivery is a no-op
    inc.commit()
    assert bases(link.sender)["bases"][0]["sent"] == 2 == bases(link.receiver)["bases"][0]["sent"]
    with pytest.raises(StaleStateError):
        retry.commit()  # encoded against a state that has moved on: not committed twice
    with pytest.raises(StaleStateError):
        retry_in.commit()
    assert bases(link.sender)["bases"][0]["sent"] == 2 == bases(link.receiver)["bases"][0]["sent"]


def one_line_mismatch(receiver, enc) -> str:
    with pytest.raises(StateMismatchError) as info:
        receiver.receive(enc)
    text = str(info.value)
    assert "\n" not in text and "basis" in text
    return text


def test_a_message_in_another_basis_version_is_refused():
    link = Link("subspace:4/every2")
    link.step(drifting(0))
    out = link.sender.send(drifting(1))
    out.commit()  # the sender moved on; the receiver never saw the message
    out = link.sender.send(drifting(2))  # a refresh: installs basis 2, but the receiver holds 1 with one message
    link.receiver.receive(wire.decode(out.payload))  # accepted: 2 follows 1
    out.commit()
    out = link.sender.send(drifting(3))
    link.receiver.reset()  # a receiver that lost its basis
    assert "payload is in basis 2, this end holds none" in one_line_mismatch(link.receiver, wire.decode(out.payload))
    # a refresh that skips a version
    link = Link("subspace:4/every1")
    link.step(drifting(0))
    link.sender.send(drifting(1)).commit()
    text = one_line_mismatch(link.receiver, wire.decode(link.sender.send(drifting(2)).payload))
    assert "installs basis 3, this end holds basis 1" in text


def test_payloads_of_another_format_or_rank_are_refused():
    link = Link("subspace:4")
    other = Link("subspace:4/q8")
    with pytest.raises(PayloadError, match="subspace:4/q8 payload on a subspace:4 link"):
        link.receiver.receive(wire.decode(other.sender.send(torch.randn(6, 16)).payload))
    lowrank = parse("lowrank:4").sender().send(torch.randn(6, 16)).payload
    with pytest.raises(PayloadError, match="lowrank:4/fp16 payload on a subspace:4 link"):
        link.receiver.receive(wire.decode(lowrank))
    link.step(torch.randn(6, 16))
    rank2 = Link("subspace:2")
    rank2.step(torch.randn(6, 16))
    rank2.step(torch.randn(6, 16))
    with pytest.raises(PayloadError, match="rank-2 subspace payload in basis 1 of rank 4"):
        link.receiver.receive(wire.decode(rank2.sender.send(torch.randn(6, 16)).payload))


def test_evaluation_messages_carry_their_basis_and_touch_no_state():
    link = Link("subspace:4")
    link.step(drifting(0))
    before = bases(link.sender)
    x = rank_r((4, 64, 48), 4)
    enc = wire.decode(link.sender.send_stateless(x).payload)
    assert enc.body.basis_version == 0 and enc.body.basis is not None
    y = link.receiver.receive_stateless(enc).tensor
    assert rel_error(x, y) < 3e-3
    assert parse("subspace:4").receiver().receive_stateless(enc).tensor.equal(y)  # any end reads it
    assert bases(link.sender)["bases"][0]["sent"] == before["bases"][0]["sent"] == 1
    normal = wire.decode(link.sender.send(x).payload)
    with pytest.raises(PayloadError, match="needs the link's basis"):
        parse("subspace:4").codec.decode(normal)


def test_checkpoint_carries_the_basis():
    link = Link("subspace:4/q8/every3")
    for t in range(4):
        link.step(drifting(t))
    buf = io.BytesIO()
    torch.save({"s": link.sender.state_dict(), "r": link.receiver.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    copy = Link("subspace:4/q8/every3")
    copy.sender.load_state_dict(saved["s"])
    copy.receiver.load_state_dict(saved["r"])
    assert_same_bases(copy.sender, link.sender)
    assert copy.sender.state_bytes == link.sender.state_bytes == 4 * 48 * 4
    for t in range(4, 8):  # the copy goes on as the original does, byte for byte
        a, b = link.step(drifting(t))[0].payload, copy.step(drifting(t))[0].payload
        assert a == b
    with pytest.raises(ValueError, match="has a subspace basis state, this Sender keeps none"):
        parse("lowrank:4").sender().load_state_dict(saved["s"])
    with pytest.raises(ValueError, match="has no subspace basis state, this Receiver keeps one"):
        copy.receiver.load_state_dict({})


def test_reset_starts_both_ends_over():
    link = Link("subspace:4")
    for t in range(3):
        link.step(drifting(t))
    link.sender.reset()
    link.receiver.reset()
    assert link.sender.state_bytes == link.receiver.state_bytes == 0
    _, enc, _ = link.step(drifting(3))
    assert enc.body.basis is not None and enc.body.basis_version == 1
    assert_same_bases(link.sender, link.receiver)


def test_subspace_links_keep_state_and_refuse_non_finite_input():
    assert keeps_state("subspace:4") and keeps_state("fp16", "subspace:4/q8") and not keeps_state("lowrank:4")
    link = Link("subspace:4")
    x = torch.randn(6, 16)
    link.step(x)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 3] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            link.sender.send(y)
        with pytest.raises(ValueError, match="NaN or infinite"):
            link.sender.send_stateless(y)
