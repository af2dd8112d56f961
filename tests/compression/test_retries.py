"""Error feedback: commits, retries and state versions (nothing diverges silently)."""

from __future__ import annotations

import pytest
import torch
from _feedback_cases import MIRRORED, Link, dataset
from _util import make
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import wire
from swarm.compression import StaleStateError, StateMismatchError, parse

# ---- 7. commits and retries ------------------------------------------------------------------------


def _snap(link, shape, ids):
    return link.state("sender", shape, ids), link.state("receiver", shape, ids)


def _same(a, b):
    (sa, sva), (ra, rva) = a
    (sb, svb), (rb, rvb) = b
    return torch.equal(sa, sb) and sva == svb and torch.equal(ra, rb) and rva == rvb


@pytest.mark.parametrize("spec", MIRRORED)
def test_uncommitted_message_leaves_state_unchanged(spec):
    link = Link(spec)
    base, _ = dataset()
    ids = [0, 1, 2]
    link.step(base[ids], ids, warmup=True)
    link.step(base[ids] * 1.1, ids)
    before = _snap(link, base[ids].shape, ids)
    out = link.sender.send(base[ids] * 0.5, sample_ids=ids)
    inc = link.receiver.receive(wire.decode(out.payload), sample_ids=ids)
    assert _same(before, _snap(link, base[ids].shape, ids))
    del out, inc
    # and the link still works: the next message is accepted
    link.step(base[ids], ids)
    link.assert_mirrored(base[ids].shape, ids)


@pytest.mark.parametrize("spec", MIRRORED)
def test_commit_twice_is_a_no_op(spec):
    link = Link(spec)
    base, drift = dataset()
    ids = [4, 5]
    x = base[ids]
    out, inc = link.step(x, ids)
    after_one = _snap(link, x.shape, ids)
    out.commit()
    inc.commit()
    assert _same(after_one, _snap(link, x.shape, ids))
    (_, sv), (_, rv) = after_one
    assert set(sv) == {1} and set(rv) == {1}
    # the next message still goes through
    link.step(x + drift[ids], ids)
    link.assert_mirrored(x.shape, ids)


@pytest.mark.parametrize("spec", MIRRORED)
def test_duplicate_delivery_is_detected(spec):
    """The same payload received twice (sender never confirmed it): the second one is refused."""
    link = Link(spec)
    base, _ = dataset()
    ids = [0, 1]
    x = base[ids]
    out = link.sender.send(x, sample_ids=ids)
    link.receiver.receive(wire.decode(out.payload), sample_ids=ids).commit()
    before = link.state("receiver", x.shape, ids)
    with pytest.raises(StateMismatchError):
        link.receiver.receive(wire.decode(out.payload), sample_ids=ids)
    after = link.state("receiver", x.shape, ids)
    assert torch.equal(before[0], after[0]) and before[1] == after[1]


@pytest.mark.parametrize("spec", MIRRORED)
def test_retransmission_after_receiver_commit_is_detected(spec):
    """Receiver committed, the sender did not (ack lost) and sends again: StateMismatchError."""
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1]
    x = base[ids]
    out = link.sender.send(x, sample_ids=ids)
    link.receiver.receive(wire.decode(out.payload), sample_ids=ids).commit()
    retry = link.sender.send(x, sample_ids=ids)  # same input, recomputed against the sender's state
    with pytest.raises(StateMismatchError):
        link.receiver.receive(wire.decode(retry.payload), sample_ids=ids)
    nxt = link.sender.send(x + drift[ids], sample_ids=ids)
    with pytest.raises(StateMismatchError):
        link.receiver.receive(wire.decode(nxt.payload), sample_ids=ids)


@pytest.mark.parametrize("spec", MIRRORED)
def test_sender_commit_without_receiver_commit_is_detected(spec):
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1]
    out = link.sender.send(base[ids], sample_ids=ids)
    link.receiver.receive(wire.decode(out.payload), sample_ids=ids)  # decoded, never committed
    out.commit()
    nxt = link.sender.send(base[ids] + drift[ids], sample_ids=ids)
    with pytest.raises(StateMismatchError):
        link.receiver.receive(wire.decode(nxt.payload), sample_ids=ids)


@pytest.mark.parametrize("spec", MIRRORED)
def test_stale_pending_commit_raises(spec):
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1]
    first = link.sender.send(base[ids], sample_ids=ids)
    second = link.sender.send(base[ids] + drift[ids], sample_ids=ids)  # also against version 0
    r_first = link.receiver.receive(wire.decode(first.payload), sample_ids=ids)
    r_second = link.receiver.receive(wire.decode(second.payload), sample_ids=ids)
    first.commit()
    r_first.commit()
    snap = _snap(link, base[ids].shape, ids)
    with pytest.raises(StaleStateError):
        second.commit()
    with pytest.raises(StaleStateError):
        r_second.commit()
    assert _same(snap, _snap(link, base[ids].shape, ids))
    link.assert_mirrored(base[ids].shape, ids)


@pytest.mark.parametrize("spec", ["topk:0.1+ef", "quant:2+ef/sample", "topk:0.2+efmixed"])
def test_ef_sender_commit_semantics(spec):
    parsed = parse(spec)
    sender = parsed.sender()
    ids = [0, 1]
    keys = ids if parsed.per_sample else None
    x = make((2, 30))
    sender.send(x, sample_ids=ids).commit()
    before = sender.table.load((2, 30), keys, "cpu")
    sender.send(x * 2, sample_ids=ids)  # never committed
    after = sender.table.load((2, 30), keys, "cpu")
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    a = sender.send(x, sample_ids=ids)
    b = sender.send(x, sample_ids=ids)
    a.commit()
    once = sender.table.load((2, 30), keys, "cpu")
    a.commit()
    twice = sender.table.load((2, 30), keys, "cpu")
    assert torch.equal(once[0], twice[0]) and once[1] == twice[1]
    with pytest.raises(StaleStateError):
        b.commit()


@pytest.mark.parametrize("spec", ["quant:3+ef21", "topk:0.2+aqsgd"])
def test_reset_both_ends_resynchronizes(spec):
    link = Link(spec)
    base, _ = dataset()
    ids = [0, 1]
    out = link.sender.send(base[ids], sample_ids=ids)
    link.receiver.receive(wire.decode(out.payload), sample_ids=ids).commit()  # out of sync now
    with pytest.raises(StateMismatchError):
        link.receiver.receive(wire.decode(link.sender.send(base[ids], sample_ids=ids).payload), sample_ids=ids)
    link.sender.reset()
    link.receiver.reset()
    link.step(base[ids], ids, warmup=True)
    link.step(base[ids] * 1.5, ids)
    link.assert_mirrored(base[ids].shape, ids)


@pytest.mark.parametrize("spec", ["quant:3+ef21", "topk:0.3+aqsgd/q4", "topk:0.2/q8+ef21/sample"])
@settings(max_examples=60)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 7), st.booleans(), st.booleans(), st.integers(0, 3)), min_size=1, max_size=25
    )
)
def test_lossy_link_never_diverges_silently(spec, plan):
    """Random delivery: messages lost, duplicated, replayed late; acks lost. The sender commits a
    message only when the receiver accepted and committed it (an ack). Whenever the receiver
    accepts a message, its output is exactly what the sender computed, so the ends never
    silently disagree."""
    link = Link(spec)
    base, drift = dataset()
    ids = [0, 1, 2]
    sent = []  # (payload, outgoing, expected receiver output)
    for t, (replay, delivered, acked, _) in enumerate(plan):
        x = base[ids] + 0.05 * t * drift[ids]
        s_state, _ = link.state("sender", x.shape, ids)
        out = link.sender.send(x, sample_ids=ids)
        enc = wire.decode(out.payload)
        expected = x if enc.stamp.warmup else (s_state + link.spec.codec.decode(enc).float()).to(x.dtype)
        sent.append((out.payload, out, expected))
        candidates = [len(sent) - 1] if delivered else []
        if replay < len(sent) - 1:
            candidates.append(replay)  # a late duplicate of an older message
        for i in candidates:
            payload, outgoing, exp = sent[i]
            try:
                inc = link.receiver.receive(wire.decode(payload), sample_ids=ids)
            except StateMismatchError:
                continue
            assert torch.equal(inc.tensor, exp), "receiver accepted a message computed against other state"
            inc.commit()
            if acked:
                try:
                    outgoing.commit()
                except StaleStateError:
                    pytest.fail("sender could not commit a message the receiver accepted")
        s, sv = link.state("sender", x.shape, ids)
        r, rv = link.state("receiver", x.shape, ids)
        if sv == rv:
            assert torch.equal(s, r), "equal versions but different state"
