"""The stage protocol's calls: every request kind once, with who may make it.

A kind is a field of the `head` oneof of `StageRequest` (stage.proto); its request and reply heads
are that field's message types in `StageRequest` and `StageReply`. Everything that treats calls by
kind derives from this table: the stage server's dispatch (a handler `rpc_<kind>` per kind) and its
trust gate, the signing of the owner's calls, the clients' typed stubs (protocols.stubs) and the fuzzer's cases;
a test checks it against stage.proto (every kind exactly once). Adding a call: its messages in
stage.proto, its line here, its stub (protocols.stubs), its handler, its client call, its test and its line in docs/security.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from protocols import stage_pb2 as pb


class Trust(StrEnum):
    """Who may make a call, checked on its head before any of its payload is read."""

    OWNER = "the run's owner"  # a control call, signed by the owner's key
    NEIGHBOUR = "a neighbour"  # a micro-batch: a member admitted to the stage before (stage 0: the trainer)
    MEMBER = "a member"  # a state download: a member of the session the owner's newest roster lists
    OPEN = "anyone"  # read-only status


@dataclass(frozen=True)
class Call:
    kind: str
    trust: Trust
    what: str  # one line for the docs and the fuzzer's report

    @property
    def request(self) -> type:
        return _HEADS[pb.StageRequest][self.kind]

    @property
    def reply(self) -> type:
        return _HEADS[pb.StageReply][self.kind]

    @property
    def signed(self) -> bool:
        return self.trust is Trust.OWNER


def _heads(message_type) -> dict[str, type]:
    oneof = message_type.DESCRIPTOR.oneofs_by_name["head"]
    return {f.name: getattr(pb, f.message_type.name) for f in oneof.fields}


_HEADS = {pb.StageRequest: _heads(pb.StageRequest), pb.StageReply: _heads(pb.StageReply)}

CALLS: dict[str, Call] = {
    call.kind: call
    for call in (
        Call("micro_batch", Trust.NEIGHBOUR, "a micro-batch's forward, its chain downstream and its backward"),
        Call("setup", Trust.OWNER, "a trainer session sets the stage up (mid-run: to join)"),
        Call("info", Trust.OPEN, "status: the stages hosted, their links and events"),
        Call("gather", Trust.OWNER, "the step's round 1: sum the held gradients, with replicas and tied stages"),
        Call("set_grads", Trust.OWNER, "round 2: replace gradients (the squared norm back)"),
        Call("apply", Trust.OWNER, "round 3: scale, step the optimizer, switch codecs"),
        Call("save", Trust.OWNER, "a checkpoint of the stage"),
        Call("load", Trust.OWNER, "install a checkpoint"),
        Call("state", Trust.MEMBER, "a joiner's download of the stage's state, or of a copy"),
        Call("snapshot", Trust.OWNER, "keep a copy of the stage and fetch the neighbours' copies"),
        Call("restore", Trust.OWNER, "go back to a copy"),
    )
}

OWNER_CALLS = frozenset(kind for kind, call in CALLS.items() if call.trust is Trust.OWNER)
