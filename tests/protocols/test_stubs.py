"""The typed client stubs (protocols.stubs) against the call registry, and every client call site
naming stubs, never kinds' strings."""

from __future__ import annotations

import ast
import dataclasses

import pytest
from _util import REPO

from protocols import stage_pb2 as pb
from protocols.calls import CALLS, Call, Trust
from protocols.stubs import STUBS, derive


def test_every_registered_kind_has_a_stub_with_the_registry_types():
    assert sorted(f.name for f in dataclasses.fields(STUBS)) == sorted(CALLS)
    for kind, call in CALLS.items():
        stub = getattr(STUBS, kind)
        assert (stub.kind, stub.request, stub.reply) == (kind, call.request, call.reply)
        request = stub(to=pb.Address(run_id="run"))
        assert request.kind == kind and isinstance(request.head, call.request) and request.head.to.run_id == "run"


def test_a_stub_refuses_a_field_its_head_does_not_have():
    with pytest.raises(ValueError, match="no_such_field"):
        STUBS.save(no_such_field=1)


def test_a_registry_kind_without_a_stub_or_a_stub_without_a_kind_fails_the_derivation():
    grown = {**CALLS, "ping": Call("ping", Trust.OPEN, "a kind with no stub")}
    with pytest.raises(TypeError, match=r"kinds without a stub \['ping'\]"):
        derive(grown)
    shrunk = {kind: call for kind, call in CALLS.items() if kind != "save"}
    with pytest.raises(TypeError, match=r"stubs of no registered kind \['save'\]"):
        derive(shrunk)


def test_a_stub_whose_types_are_not_the_registry_fails_the_derivation():
    class Swapped(Call):  # the registry's save call, answered by load's reply
        @property
        def reply(self) -> type:
            return pb.LoadReply

    with pytest.raises(TypeError, match="the save stub's types"):
        derive({**CALLS, "save": Swapped("save", Trust.OWNER, "a save answered by load's reply")})


def test_a_stub_takes_a_head_built_elsewhere_only_of_its_own_type():
    head = pb.StateRequest(to=pb.Address(run_id="run"), snapshot=True)
    request = STUBS.state.of(head)
    assert request.kind == "state" and request.head is head
    with pytest.raises(TypeError, match="the info stub takes InfoRequest heads, not StateRequest"):
        STUBS.info.of(head)


def test_no_client_call_site_names_a_kind_by_its_string():
    """Clients call through stubs (the trainer, joining, copies, the live export, the survey, the
    fuzz campaign): no call of `call`, `ask` or a rounds' `call` takes a kind's string (a span or
    an event may share a kind's name: they are not calls). net/calls.py's `ask` is the one place
    that hands a stub's kind to `call`."""
    named = []
    for path in sorted(p for package in ("swarm", "peers") for p in (REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in ("call", "ask", "request"):
                strings = [a.value for a in node.args if isinstance(a, ast.Constant) and a.value in CALLS]
                named += [f"{path.relative_to(REPO)}:{node.lineno} {s}" for s in strings]
    assert named == []
