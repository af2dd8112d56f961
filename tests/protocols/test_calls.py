"""The registry of the stage protocol's calls against the server's handlers and the uses derived from
it (against stage.proto: test_stage_proto.py)."""

from __future__ import annotations

from protocols.calls import CALLS, OWNER_CALLS, Trust
from swarm.bench.fuzz_cases import CONTROL_HEADS
from swarm.transport.hivemind.stage.server import HANDLERS


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
