"""The .proto files are the protocol: each generated module must be what its .proto compiles to
(an edit of stage.proto without regenerating fails here), and the call registry must match
stage.proto itself, compiled here with grpc_tools (an edit of the registry without the proto fails)."""

from __future__ import annotations

import functools
import importlib
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

import protocols
from protocols.calls import CALLS

PROTOS = Path(protocols.__file__).parent
REGENERATE = "python -m grpc_tools.protoc -I protocols --python_out=protocols protocols/{}"


@functools.cache
def compiled(name: str) -> descriptor_pb2.FileDescriptorProto:
    """protocols/`name` as protoc compiles it, less the JSON names the generated modules leave out."""
    with tempfile.TemporaryDirectory() as out:
        descriptors = Path(out) / "descriptors.pb"
        failed = protoc.main(["protoc", f"-I{PROTOS}", f"--descriptor_set_out={descriptors}", str(PROTOS / name)])
        assert not failed, f"protoc could not compile protocols/{name}"
        (proto,) = descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file
    _drop_json_names(proto.message_type)
    return proto


def _drop_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def _messages(proto: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.DescriptorProto]:
    return {message.name: message for message in proto.message_type}


@pytest.mark.parametrize("name", sorted(p.name for p in PROTOS.glob("*.proto")))
def test_every_generated_module_is_what_its_proto_compiles_to(name):
    module = importlib.import_module(f"protocols.{name.removesuffix('.proto')}_pb2")
    generated = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    proto = compiled(name)
    if generated != proto:
        old, new = _messages(generated), _messages(proto)
        changed = sorted(m for m in old.keys() | new.keys() if old.get(m) != new.get(m)) or ["its enums or options"]
        pytest.fail(f"protocols/{name} changed ({', '.join(changed)}): regenerate with {REGENERATE.format(name)}")


def test_the_registry_is_stage_proto_request_kinds_each_with_its_heads():
    messages = _messages(compiled("stage.proto"))

    def heads(envelope: str) -> dict[str, str]:
        message = messages[envelope]
        (head,) = [i for i, oneof in enumerate(message.oneof_decl) if oneof.name == "head"]
        fields = [f for f in message.field if f.HasField("oneof_index") and f.oneof_index == head]
        assert len({f.name for f in fields}) == len(fields) == len({f.number for f in fields})
        return {f.name: f.type_name.removeprefix(".") for f in fields}  # e.g. "hivepipe.stage.SaveRequest"

    requests, replies = heads("StageRequest"), heads("StageReply")
    assert sorted(requests) == sorted(CALLS)  # every kind of the proto registered, none it lacks
    assert sorted(replies) == sorted([*CALLS, "error"])  # each kind's reply, and errors
    for kind, call in CALLS.items():
        assert call.kind == kind and call.what
        assert (call.request.DESCRIPTOR.full_name, call.reply.DESCRIPTOR.full_name) == (requests[kind], replies[kind])
        for registered, message in ((call.request, requests[kind]), (call.reply, replies[kind])):
            in_proto = {(f.name, f.number) for f in messages[message.removeprefix("hivepipe.stage.")].field}
            assert {(f.name, f.number) for f in registered.DESCRIPTOR.fields} == in_proto, message
