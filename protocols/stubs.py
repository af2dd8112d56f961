"""Typed client stubs of the stage protocol: one per call kind of the registry (protocols.calls).

A stub builds its kind's request head from the head's fields and keeps the kind with it, so a call
site names a typed stub (`STUBS.setup(to=..., session=...)`), never a kind's string, and cannot
send a head under another kind's name. Each stub's request and reply types are the registry's
(which reads them from stage.proto's `head` oneofs); at import, every kind of the registry must have
its stub here, with those types, or the import fails.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

from protocols import stage_pb2 as pb
from protocols.calls import CALLS

Req = TypeVar("Req")
Rep = TypeVar("Rep")


@dataclass(frozen=True)
class Request(Generic[Req, Rep]):
    """A call's request head, with the stub that built it: what the client stack sends."""

    stub: Stub[Req, Rep]
    head: Req

    @property
    def kind(self) -> str:
        return self.stub.kind


@dataclass(frozen=True)
class Stub(Generic[Req, Rep]):
    """One call kind's client side: its request head from the head's fields (`stub(**fields)`)."""

    kind: str
    request: type[Req]
    reply: type[Rep]

    def __call__(self, **head_fields) -> Request[Req, Rep]:
        return Request(self, self.request(**head_fields))

    def of(self, head: Req) -> Request[Req, Rep]:
        """A head built elsewhere (e.g. with an admission or a roster in it), sent as this kind."""
        if not isinstance(head, self.request):
            raise TypeError(f"the {self.kind} stub takes {self.request.__name__} heads, not {type(head).__name__}")
        return Request(self, head)


@dataclass(frozen=True)
class Stubs:
    """The stubs, by kind; the annotations are the static types, checked against the registry."""

    micro_batch: Stub[pb.MicroBatchHead, pb.ResultHead]
    setup: Stub[pb.SetupRequest, pb.SetupReply]
    info: Stub[pb.InfoRequest, pb.InfoReply]
    gather: Stub[pb.GatherRequest, pb.GatherReply]
    set_grads: Stub[pb.SetGradsRequest, pb.SetGradsReply]
    apply: Stub[pb.ApplyRequest, pb.ApplyReply]
    save: Stub[pb.SaveRequest, pb.SaveReply]
    load: Stub[pb.LoadRequest, pb.LoadReply]
    state: Stub[pb.StateRequest, pb.StateReply]
    snapshot: Stub[pb.SnapshotRequest, pb.SnapshotReply]
    restore: Stub[pb.RestoreRequest, pb.RestoreReply]


def derive(calls=CALLS) -> Stubs:
    """A stub per kind of `calls`, each checked against its annotation in `Stubs`."""
    declared = {f.name for f in fields(Stubs)}
    if declared != set(calls):
        missing, extra = sorted(set(calls) - declared), sorted(declared - set(calls))
        raise TypeError(f"protocols.stubs: kinds without a stub {missing}, stubs of no registered kind {extra}")
    hints = typing.get_type_hints(Stubs)
    for kind, call in calls.items():
        if typing.get_args(hints[kind]) != (call.request, call.reply):
            raise TypeError(
                f"protocols.stubs: the {kind} stub's types are not the registry's {call.request, call.reply}"
            )
    return Stubs(**{kind: Stub(kind, call.request, call.reply) for kind, call in calls.items()})


STUBS = derive()
