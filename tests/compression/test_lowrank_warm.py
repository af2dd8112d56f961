"""swarm.compression.warm: lowrank:R/warm, the sender's warm start kept per link (PowerSGD's):
cold first, one power iteration from the last delivered message, committed on delivery only,
reset and checkpoints, plain messages on the wire, error feedback."""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_lowrank import rel_error
from test_subspace import Link

from protocols import wire
from swarm.compression import StaleStateError, parse
from swarm.compression import lowrank as lowrank_module
from swarm.compression.spec import keeps_state


def turning(t: int, shape=(4, 64, 48), r: int = 8, noise: float = 0.05) -> torch.Tensor:
    """Low rank plus noise as activations are: fresh tokens every micro-batch t, in a rank-r row
    space (singular values over 10x) that turns slowly with t."""
    g = torch.Generator().manual_seed(7)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    a = torch.randn(cols, cols, generator=g)
    right = torch.linalg.matrix_exp(0.01 * t * (a - a.T)) @ torch.linalg.qr(torch.randn(cols, r, generator=g)).Q
    tokens = torch.Generator().manual_seed(100 + t)
    left = torch.randn(rows, r, generator=tokens) * torch.logspace(1, 0, r)
    return (left @ right.T + noise * torch.randn(rows, cols, generator=tokens)).reshape(shape)


def cold(spec: str, x: torch.Tensor) -> bytes:
    return parse(spec.replace("/warm", "")).sender().send(x).payload


def held(link: Link) -> list[dict]:
    return link.sender.codec.link_state.state_dict()["bases"]


@pytest.mark.parametrize("spec", ["lowrank:8/warm", "lowrank:8/q8/warm", "lowrank:8/fp32/warm", "lowrank:8/bf16/warm"])
def test_the_first_message_is_plain_lowranks(spec):
    link = Link(spec)
    x = turning(0)
    assert link.step(x)[0].payload == cold(spec, x)
    [state] = held(link)
    assert (state["cols"], state["version"], tuple(state["vectors"].shape)) == (48, 1, (8, 48))
    vectors = state["vectors"]  # orthonormal rows, float32 on the CPU
    assert vectors.dtype == torch.float32 and vectors.device.type == "cpu"
    assert torch.allclose(vectors @ vectors.T, torch.eye(8), atol=1e-5)


def falling(t: int, shape=(8, 64, 96)) -> torch.Tensor:
    """Fresh tokens every micro-batch t with a slowly falling spectrum (singular value i ~ 1/sqrt(i),
    no gap for a power iteration to use) in directions that turn slowly with t."""
    g = torch.Generator().manual_seed(7)
    cols = shape[-1]
    a = torch.randn(cols, cols, generator=g)
    directions = torch.linalg.matrix_exp(0.01 * t * (a - a.T)) @ torch.linalg.qr(torch.randn(cols, cols, generator=g)).Q
    tokens = torch.randn((math.prod(shape[:-1]), cols), generator=torch.Generator().manual_seed(100 + t))
    return ((tokens * torch.arange(1, cols + 1).float().rsqrt()) @ directions.T).reshape(shape)


def warm_and_cold_errors(spec: str, data, messages: int = 6) -> list[tuple[float, float]]:
    """(warm error, cold error) of messages 1.. after a first one on a warm link, asserting that
    each was encoded from the committed start: other bytes than plain lowrank's."""
    link, plain = Link(spec), parse(spec.replace("/warm", ""))
    link.step(data(0))
    errors = []
    for t in range(1, messages + 1):
        x = data(t)
        out, _, inc = link.step(x)
        assert out.payload != cold(spec, x) and held(link)[0]["version"] == t + 1
        errors.append((rel_error(x, inc.tensor), rel_error(x, plain.codec.decode(plain.codec.encode(x)))))
    return errors


@pytest.mark.parametrize("spec", ["lowrank:8/warm", "lowrank:8/q8/warm"])
def test_on_low_rank_plus_noise_one_warm_iteration_is_as_good_as_two_cold(spec):
    """A rank-8 row space that turns, plus noise: from the second message on, one power iteration
    from the held directions does as well as two from the fixed sketch, within 1%."""
    for warm, cold_error in warm_and_cold_errors(spec, turning):
        assert warm <= 1.01 * cold_error, (warm, cold_error)


@pytest.mark.parametrize("spec", ["lowrank:8/warm", "lowrank:16/warm"])
def test_on_a_falling_spectrum_the_warm_start_does_better_than_cold(spec):
    """No gap in the spectrum: the held directions carry the iterations of earlier messages, so
    every warm message has a lower error than a cold one (a random start with one iteration has a
    1-3% higher error than cold on these tensors: this test would catch a start that is not the
    delivered message's)."""
    errors = warm_and_cold_errors(spec, falling)
    assert all(warm < cold_error for warm, cold_error in errors), errors
    assert sum(w for w, _ in errors) < 0.997 * sum(c for _, c in errors), errors


def test_one_power_iteration_instead_of_two(monkeypatch):
    """Cold: the sketch's basis and two rounds of two orthonormalizations; warm: one round."""
    calls = []
    original = lowrank_module._orthonormal
    monkeypatch.setattr(lowrank_module, "_orthonormal", lambda y: calls.append(1) or original(y))
    link = Link("lowrank:8/warm")
    link.step(turning(0))
    assert len(calls) == 1 + 2 * lowrank_module.ITERATIONS == 5
    calls.clear()
    link.step(turning(1))
    assert len(calls) == 1 + 2 * lowrank_module.WARM_ITERATIONS == 3


def test_an_undelivered_message_leaves_the_start_as_it_was():
    """A failed send (never committed) changes nothing: the next message is what it would be from
    the last delivered one; a retry encodes the same bytes, and only one of them commits."""
    link, other = Link("lowrank:8/warm"), Link("lowrank:8/warm")
    link.step(turning(0))
    other.step(turning(0))
    link.sender.send(turning(5))  # failed: its micro-batch is retried later, or dropped
    failed = link.sender.send(turning(1))
    retry = link.sender.send(turning(1))
    expected = other.sender.send(turning(1)).payload
    assert failed.payload == retry.payload == expected != cold("lowrank:8", turning(1))
    retry.commit()
    with pytest.raises(StaleStateError, match="warm start changed"):
        failed.commit()
    assert held(link)[0]["version"] == 2
    other.step(turning(1))
    assert link.sender.send(turning(2)).payload == other.sender.send(turning(2)).payload


def test_reset_and_checkpoints():
    link = Link("lowrank:8/q8/warm")
    for t in range(3):
        link.step(turning(t))
    assert link.sender.state_bytes == 8 * 48 * 4 and link.receiver.state_bytes == 0
    buf = io.BytesIO()
    torch.save(link.sender.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert saved["basis"]["kind"] == "lowrank-warm"
    copy = Link("lowrank:8/q8/warm")
    copy.sender.load_state_dict(saved)
    assert copy.sender.state_bytes == link.sender.state_bytes
    for t in range(3, 6):  # the copy goes on as the original does, byte for byte
        assert link.step(turning(t))[0].payload == copy.step(turning(t))[0].payload
    with pytest.raises(ValueError, match="has a low-rank warm start state, this Sender keeps none"):
        parse("lowrank:8/q8").sender().load_state_dict(saved)
    with pytest.raises(ValueError, match="has no low-rank warm start state, this Sender keeps one"):
        copy.sender.load_state_dict({})
    with pytest.raises(ValueError, match="holds a 'subspace' state, this link end keeps a low-rank warm start"):
        copy.sender.load_state_dict(Link("subspace:8").sender.state_dict())
    link.sender.reset()  # a new neighbour: cold again
    assert link.sender.state_bytes == 0
    assert link.step(turning(6))[0].payload == cold("lowrank:8/q8", turning(6))


def test_one_start_per_last_dimension_and_any_rows():
    link = Link("lowrank:8/warm")
    assert link.step(turning(0, shape=(3, 32)))[2].tensor.shape == (3, 32)  # rank 3: a start of 3 directions
    x = turning(0, shape=(40, 32))
    _, enc, inc = link.step(x)  # rank 8 from 3 held directions and the sketch's other columns
    assert enc.body.rank == 8 and rel_error(x, inc.tensor) < 0.1
    y = turning(1, shape=(2, 32))  # 2 rows: 2 of the 8 held directions
    _, enc, inc = link.step(y)
    assert enc.body.rank == 2 and rel_error(y, inc.tensor) < 1e-2
    other = turning(0)  # another last dimension starts cold and keeps a start of its own
    assert link.step(other)[0].payload == cold("lowrank:8", other)
    assert sorted(h["cols"] for h in held(link)) == [32, 48]


def test_the_wire_carries_plain_lowrank_messages():
    """Only the sender keeps state: a plain lowrank receiver decodes a warm sender's messages."""
    link = Link("lowrank:8/warm")
    assert link.receiver.codec.link_state is None and link.receiver.state_dict() == {}
    link.step(turning(0))
    _, enc, inc = link.step(turning(1))
    assert parse("lowrank:8").receiver().receive(enc).tensor.equal(inc.tensor)


def test_evaluation_and_warmup_messages_touch_no_state():
    link = Link("lowrank:8/warm")
    link.step(turning(0))
    before = held(link)
    x = turning(1)
    assert link.sender.send_stateless(x).payload == cold("lowrank:8", x)  # standalone: cold
    link.sender.send(x, warmup=True).commit()  # exact values: no factor to start from
    after = held(link)
    assert after[0]["version"] == before[0]["version"] and after[0]["vectors"].equal(before[0]["vectors"])


def test_warm_links_keep_state_and_refuse_non_finite_input():
    assert (
        keeps_state("lowrank:4/warm") and keeps_state("fp16", "lowrank:4/q8/warm+ef") and not keeps_state("lowrank:4")
    )
    link = Link("lowrank:4/warm")
    x = torch.randn(6, 16)
    x[:, 3] = 0.0  # the held directions are (near) zero in column 3: 0 * inf is still NaN
    link.step(x)
    for bad in (float("nan"), float("inf")):
        y = torch.randn(6, 16)
        y[2, 3] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            link.sender.send(y)


@pytest.mark.parametrize("spec", ["lowrank:4/warm+ef", "lowrank:4/warm+ef21", "lowrank:4/q8/warm+ef21/sample"])
def test_error_feedback_on_a_warm_link(spec):
    """The feedback state and the warm start live side by side: both checkpointed, both reset;
    messages after the first are warm ones."""
    link = Link(spec)
    ids = list(range(4))
    plain = parse(spec.replace("/warm", ""))
    sender, receiver = plain.sender(), plain.receiver()
    for t in range(3):
        x = turning(t)
        out = link.sender.send(x, sample_ids=ids)
        link.receiver.receive(wire.decode(out.payload), sample_ids=ids).commit()
        out.commit()
        theirs = sender.send(x, sample_ids=ids)
        receiver.receive(wire.decode(theirs.payload), sample_ids=ids).commit()
        theirs.commit()
        assert (out.payload == theirs.payload) == (t == 0)
    assert set(link.sender.state_dict()) == {"table", "basis"}
    assert set(link.receiver.state_dict()) == ({"table"} if link.spec.mirrored else set())
    assert link.sender.state_bytes == sender.state_bytes + 4 * 48 * 4
    link.sender.reset()
    assert link.sender.state_bytes == 0


def test_a_link_ends_checkpoint_carries_the_warm_starts_of_its_senders():
    """Both halves of a boundary, each sending one direction warm: what a stage checkpoint or a
    swarm copy keeps of a link end (LinkEnd.state_dict, loaded weights-only) goes on byte for
    byte; the same ends with their warm starts forgotten would not."""
    from swarm.engine.linkend import LinkEnd

    def ends():
        return [LinkEnd(0, upstream, "lowrank:8/warm", "lowrank:8/q8/warm+ef") for upstream in (True, False)]

    def step(up, down, t):
        x = turning(t)
        sent = [up.sender.send(x), down.sender.send(0.1 * x)]
        for out, receiver in zip(sent, (down.receiver, up.receiver), strict=True):
            receiver.receive(wire.decode(out.payload)).commit()
            out.commit()
        return [out.payload for out in sent]

    up, down = ends()
    for t in range(3):
        step(up, down, t)
    copies, forgetful = ends(), ends()
    for original, copy, other in zip((up, down), copies, forgetful, strict=True):
        buf = io.BytesIO()
        torch.save(original.state_dict(), buf)
        for end in (copy, other):
            buf.seek(0)
            end.load_state_dict(torch.load(buf, weights_only=True))
        other.sender.codec.link_state.reset()
    assert copies[0].state_bytes == up.state_bytes > 0 and copies[1].state_bytes == down.state_bytes
    theirs = step(*forgetful, 3)
    for t in range(3, 6):
        ours = step(up, down, t)
        assert ours == step(*copies, t)
        if t == 3:
            assert all(a != b for a, b in zip(ours, theirs, strict=True))
