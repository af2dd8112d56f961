"""The registry of the stage protocol's calls against stage.proto, the server's handlers and the
uses derived from it."""

from __future__ import annotations

from protocols import stage_pb2 as pb
from protocols.calls import CALLS, OWNER_CALLS, Trust, request
from swarm.bench.fuzz_cases import CONTROL_HEADS
from swarm.transport.hivemind.stage.server import HANDLERS


def _oneof(message_type) -> list[str]:
    return [f.name for f in message_type.DESCRIPTOR.oneofs_by_name["head"].fields]


def test_every_request_kind_of_stage_proto_is_registered_exactly_once():
    kinds = _oneof(pb.StageRequest)
    assert len(kinds) == len(set(kinds)) and sorted(kinds) == sorted(CALLS)
    assert sorted(_oneof(pb.StageReply)) == sorted([*CALLS, "error"])  # each kind's reply, and errors
    for kind, call in CALLS.items():
        assert call.kind == kind and call.what
        assert call.request.DESCRIPTOR.full_name.startswith("hivepipe.stage")
        assert isinstance(request(kind), call.request) and call.reply().DESCRIPTOR is call.reply.DESCRIPTOR


def test_every_call_has_one_handler_and_a_trust_class():
    for kind in CALLS:
        assert callable(HANDLERS.get(kind)), kind
    assert sorted(HANDLERS) == sorted(CALLS)  # no handler of a kind the protocol does not have
    assert {call.trust for call in CALLS.values()} == set(Trust)
    assert OWNER_CALLS == {kind for kind, call in CALLS.items() if call.signed}
    assert CALLS["micro_batch"].trust is Trust.NEIGHBOUR and CALLS["info"].trust is Trust.OPEN
    assert sorted(CONTROL_HEADS) == sorted(kind for kind in CALLS if kind != "micro_batch")  # the fuzzer's


def test_every_call_has_its_line_in_the_security_docs():
    from _util import REPO

    text = (REPO / "docs" / "security.md").read_text()
    table = text[text.index("| call | who may make it |") :].split("\n\n", 1)[0]
    for kind in CALLS:
        assert kind in table, kind
