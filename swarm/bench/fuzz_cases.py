"""Malformed messages for stage peers, by category (`swarm.bench.fuzz` sends them during a run).

Each case is the bytes a caller writes on one stream of the stage protocol: hivemind's message
framing (a marker, an 8-byte length, the bytes) around our frames (protocols.framing), broken on
purpose at every layer: the stream's framing, the frame's chunks, the head's fields and signature,
and, from a peer admitted to the stage before (a member whose key was stolen), the payload itself.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from protocols import carried as envelope
from protocols import compressed_tensor_pb2 as cpb
from protocols import stage_pb2 as pb
from protocols import wire
from protocols.calls import CALLS, Trust
from protocols.framing import frame_parts
from protocols.message import Encoded, Granularity, LowRankPart, QuantPart, RawPart, SubspacePart
from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.net.meta import address, batch_to_meta, micro_batch_payload
from swarm.transport.hivemind.stage.averaging import AVERAGING_NAMESPACE
from swarm.transport.hivemind.trust.admissions import issue
from swarm.transport.hivemind.trust.signatures import sign_call

# the replicas' all-reduce handler every stage peer registers (swarm.transport.hivemind.stage.averaging)
AVERAGING_HANDLER = f"{AVERAGING_NAMESPACE}::ReplicaAverager.rpc_aggregate_part"
# every call but the micro-batch (its own categories below)
CONTROL_HEADS = {kind: call.request for kind, call in CALLS.items() if call.trust is not Trust.NEIGHBOUR}


@dataclass
class Target:
    """A stage peer under test and what the fuzzer knows: the public run, and (to act as a
    member admitted to the stage before, or to mutate the owner's signed calls) the owner's key."""

    peer_id: str
    run_id: str
    stage: int
    session: str
    owner_key: RSAPrivateKey
    stranger_id: str  # the peer id of the fuzzer's stranger (never admitted)
    member_id: str  # ... and of its member (admitted to the stage before: its key was stolen)
    width: int = 32  # activations per sample at this stage's input (stage > 0)
    step: Callable[[], int] = lambda: 0  # the step the peer is at (a member's payloads pass its step guard)
    micro_batches: int = 4  # a step's training micro-batches (a replay takes a real index)


def targets_of(hosted, pipeline, stranger_id: str, member_id: str) -> list[Target]:
    """A target per in-process `HostedStage` of `pipeline`'s run (its step read as it goes)."""
    return [
        Target(
            h.node.peer_id,
            pipeline.run_id,
            h.stage,
            pipeline.session,
            pipeline.owner.key,
            stranger_id,
            member_id,
            step=lambda h=h: h.state.steps,
            micro_batches=h.state.cfg.train.micro_batches,
        )
        for h in hosted
    ]


@dataclass
class Case:
    category: str
    data: bytes  # written to a new stream as is, then the stream's end marker
    stall: bool = False  # the fuzzer stops writing half-way and waits for the peer to close the stream
    hang_up: bool = False  # the fuzzer closes the stream at once (a truncated frame's end never comes)
    member: bool = False  # sent by the fuzzer's member (else by its stranger)
    vandal: bool = False  # ... by its vandal: bytes no peer of the protocol writes, banned at its first
    handler: str | None = None  # another p2p handler of the peer than the stage protocol's
    notes: dict = field(default_factory=dict)


def framed(message: bytes) -> bytes:
    """One message as hivemind's streams carry it."""
    return P2P.MESSAGE_MARKER + len(message).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + message


def request_bytes(kind: str, head, payload: bytes = b"", **extra) -> bytes:
    return b"".join(framed(b"".join(parts)) for parts in frame_parts(pb.StageRequest, kind, head, payload, **extra))


class Cases:
    """Random cases for `target`, reproducible from `seed`."""

    def __init__(self, target: Target, seed: int = 0) -> None:
        self.t, self.rng = target, random.Random(seed)
        self.stranger_key = RSAPrivateKey()
        self._epoch = 0  # the member's link epochs: each bad payload opens a new one (no wait for order)
        t = target
        # an admission to the stage before (the trainer's, for stage 0), as if its key were stolen,
        # and one the stranger made itself
        self.stolen = issue(t.owner_key, t.run_id, t.session, t.member_id, max(t.stage - 1, 0), trainer=t.stage == 0)
        self.forged = issue(self.stranger_key, t.run_id, t.session, t.stranger_id, 0)

    def _bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def _batch(self, step: int = 0, rows: int = 4) -> MicroBatch:
        return MicroBatch(step, self.rng.randrange(1 << 16), torch.arange(rows), torch.zeros(rows, dtype=torch.long))

    def _head(self, admitted: bool, step: int | None = None, **fields) -> pb.MicroBatchHead:
        t = self.t
        sender = t.member_id if admitted else t.stranger_id
        batch = self.batch = self._batch(step if step is not None else t.step() if admitted else 0)
        head = pb.MicroBatchHead(to=address(t.run_id, t.stage), sender=sender, batch=batch_to_meta(batch), budget_s=5)
        for name, value in fields.items():
            setattr(head, name, value)
        if admitted:
            head.admission.CopyFrom(self.stolen)
        return head

    def _activations(self) -> bytes:
        """A well-formed payload for the micro-batch of the last `_head`."""
        if self.t.stage == 0:
            return micro_batch_payload(self.batch, inputs=torch.randn(4, 1, 8, 8))
        body = wire.encode(Encoded((4, self.t.width), torch.float32, RawPart(torch.randn(4, self.t.width))))
        return micro_batch_payload(self.batch, body)

    # ---- the categories ----------------------------------------------------------------------

    def random_bytes(self) -> Case:
        return Case("random bytes", self._bytes(self.rng.randint(1, 4096)), vandal=True)

    def huge_length(self) -> Case:
        length = self.rng.randint(1 << 22, (1 << 64) - 1)
        data = P2P.MESSAGE_MARKER + length.to_bytes(8, "big") + self._bytes(64)
        return Case("absurd message length", data, vandal=True)

    def truncated(self) -> Case:
        whole = request_bytes("micro_batch", self._head(False), self._activations())
        return Case("truncated frame", whole[: self.rng.randint(1, len(whole) - 1)], hang_up=True)

    def extended(self) -> Case:
        whole = request_bytes("micro_batch", self._head(False), self._activations())
        extra = self._bytes(self.rng.randint(1, 512))
        return Case("extended frame", whole + (framed(extra) if self.rng.random() < 0.5 else extra))

    def bad_chunks(self) -> Case:
        member = self.rng.random() < 0.5
        head, payload = self._head(member), self._activations()
        message = pb.StageRequest(micro_batch=head)
        message.chunk.index, message.chunk.count = 0, 1
        message.chunk.total_length, message.chunk.crc32 = len(payload), 0
        message.chunk.data = payload
        which = self.rng.randrange(5)
        if which == 0:
            message.chunk.crc32 = self.rng.getrandbits(32)  # wrong checksum
        elif which == 1:
            message.chunk.total_length = self.rng.randint(0, 1 << 62)  # wrong length
        elif which == 2:
            message.chunk.count = self.rng.randint(2, 1 << 30)  # wrong count
        elif which == 3:
            message.chunk.index = self.rng.randint(1, 1 << 30)  # out of order
        else:
            message.ClearField("chunk")  # none at all
        return Case("bad chunks", framed(message.SerializeToString()), member=member)

    def stranger_micro_batch(self) -> Case:
        fields = {
            "epoch": self.rng.choice([0, 1, (1 << 64) - 1]),
            "seq": self.rng.getrandbits(64),
            "budget_s": self.rng.choice([0.0, -1.0, 1e300, float("nan")]),
            "reply_share_bits": self.rng.choice([float("inf"), 1.0, -5.0, float("nan")]),
        }
        head = self._head(False, **fields)
        head.batch.step = self.rng.getrandbits(64)
        if self.rng.random() < 0.5:  # an admission it copied, or forged
            head.admission.CopyFrom(self.forged)
        payload = micro_batch_payload(self.batch, inputs=torch.full((4, 8), float("nan")))
        return Case("stranger's micro-batch", request_bytes("micro_batch", head, payload))

    def big_head(self) -> Case:
        """A head far over the limit (up to 1 MiB), refused before anything else of it is read."""
        head = self._head(False)
        head.sender = "x" * self.rng.randint(65 << 10, 1 << 20)
        return Case("oversized head", request_bytes("micro_batch", head, self._activations()), vandal=True)

    def control(self) -> Case:
        t = self.t
        kind = self.rng.choice(list(CONTROL_HEADS))
        head = CONTROL_HEADS[kind](to=address(t.run_id, t.stage))
        self._mutate(head)
        payload = self._bytes(self.rng.choice([0, 16, 4096]))
        how = self.rng.randrange(4)
        extra = {}
        if how == 1:  # signed by a stranger
            extra["auth"] = sign_call(self.stranger_key, kind, head, payload, t.peer_id)
        elif how == 2:  # the owner's signature, then the head changed
            extra["auth"] = sign_call(t.owner_key, kind, head, payload, t.peer_id)
            head.to.run_id += "x"
        elif how == 3:  # the owner's signature for another peer
            extra["auth"] = sign_call(t.owner_key, kind, head, payload, t.stranger_id)
        return Case(f"{kind} call", request_bytes(kind, head, payload, **extra))

    def _mutate(self, head) -> None:
        """Random values in a few of the head's scalar fields."""
        scalars = [f for f in head.DESCRIPTOR.fields if not f.is_repeated and f.message_type is None]
        for f in self.rng.sample(scalars, min(len(scalars), self.rng.randint(0, 3))):
            if f.type == f.TYPE_STRING:
                setattr(head, f.name, self._bytes(8).hex())
            elif f.type == f.TYPE_BOOL:
                setattr(head, f.name, True)
            elif f.type == f.TYPE_DOUBLE:
                setattr(head, f.name, self.rng.choice([float("inf"), -1.0, 1e308, float("nan")]))
            elif f.type in (f.TYPE_UINT64, f.TYPE_UINT32):
                setattr(head, f.name, self.rng.getrandbits(32 if f.type == f.TYPE_UINT32 else 64))
            elif f.type == f.TYPE_BYTES:
                setattr(head, f.name, self._bytes(16))

    def member_payload(self) -> Case:
        """From a member admitted to the stage before: its own link, garbage in the payload."""
        t = self.t
        which = self.rng.randrange(10)
        shape = (4, t.width)
        if which == 0:  # absurd shape
            enc = Encoded((1 << 20, 1 << 20), torch.float32, RawPart(torch.zeros(1)))
        elif which == 1:  # NaN values
            enc = Encoded(shape, torch.float32, RawPart(torch.full(shape, float("nan"))))
        elif which == 2:  # quantization ranges that are not finite
            codes = torch.zeros(4 * t.width, dtype=torch.uint8)
            ranges = torch.tensor([float("inf")]), torch.ones(1)
            enc = Encoded(shape, torch.float32, QuantPart(8, Granularity.TENSOR, codes, *ranges))
        elif which == 6:  # low-rank factors that are not finite
            left, right = RawPart(torch.full((2 * 4,), float("inf"))), RawPart(torch.randn(2 * t.width))
            enc = Encoded(shape, torch.float32, LowRankPart(2, left, right))
        elif which == 7:  # a rank the matrix cannot have, with factors of another one
            enc = Encoded(
                shape, torch.float32, LowRankPart(64, RawPart(torch.randn(8)), RawPart(torch.randn(2 * t.width)))
            )
        elif which == 8:  # subspace coefficients that are not finite, with a basis
            coefficients, basis = RawPart(torch.full((2 * 4,), float("inf"))), RawPart(torch.rand(2 * t.width) - 0.5)
            enc = Encoded(shape, torch.float32, SubspacePart(2, 1, coefficients, basis))
        elif which == 9:  # coefficients in a basis version no end of the link installed
            enc = Encoded(shape, torch.float32, SubspacePart(2, 1 << 40, RawPart(torch.randn(2 * 4).half())))
        else:
            enc = Encoded(shape, torch.float32, RawPart(torch.randn(shape)))
        try:
            payload = wire.encode(enc)
        except Exception:
            payload = self._bytes(64)
        if which == 3:  # truncated
            payload = payload[: len(payload) // 2]
        elif which == 4:  # another format version, checksum made right
            message = cpb.CompressedTensor.FromString(payload)
            message.format_version = 99
            payload = message.SerializeToString()
        elif which == 5:
            payload = self._bytes(self.rng.randint(1, 2048))
        epoch = self._next_epoch()
        head = self._head(True, epoch=epoch if self.rng.random() < 0.95 else (1 << 64) - 1)
        return Case("member's bad payload", request_bytes("micro_batch", head, self._carrying(payload)), member=True)

    def _carrying(self, body: bytes) -> bytes:
        """`body` behind the tensors the micro-batch carries, or behind broken ones."""
        which = self.rng.randrange(8)
        payload = micro_batch_payload(self.batch, body)
        if which == 0:  # an absurd length of the carried tensors
            return self.rng.getrandbits(64).to_bytes(8, "little") + payload[8:]
        if which == 1:  # too few bytes to hold even that length
            return payload[: self.rng.randrange(8)]
        if which == 2:  # targets in a type that cannot hold them, or the wrong number of bytes
            carried, rest = envelope.unpack(payload)
            carried.targets.stored = self.rng.choice(["float32", "int64", "uint16", "bogus"])
            return envelope.pack(carried, rest)
        return payload

    def zeros_after_refusal(self) -> Case:
        """A stranger's refused micro-batch, then zeros: what the peer drains after a refusal must
        not cost it more than the bytes (zeros frame as empty messages)."""
        head = self._head(False)
        refused = request_bytes("micro_batch", head, micro_batch_payload(self.batch, inputs=torch.zeros(4, 8)))
        return Case("zeros after a refusal", refused + bytes(self.rng.choice([1 << 16, 1 << 20])))

    def stale_micro_batch(self) -> Case:
        """A member's well-formed micro-batch of a past step (a replay): refused as the message's
        fault, so its sender's upstream never takes the peer for unavailable."""
        step = self.t.step()
        if step == 0:  # no past step yet
            return self.random_bytes()
        head = self._head(True, step=self.rng.randrange(step), epoch=self._next_epoch())
        return Case("member's past micro-batch", request_bytes("micro_batch", head, self._activations()), member=True)

    def replayed_micro_batch(self) -> Case:
        """A member's well-formed micro-batch of the step the peer is at, with a real index and an
        attempt of its own, and a budget that is not a number or never ends: it never counts toward
        the step (the gather names the trainer's attempts), and it is never held past the call timeout.
        Stage 0's sender is the trainer (whose admission is the owner's key): nothing to replay there."""
        if self.t.stage == 0:
            return self.stale_micro_batch()
        head = self._head(True, step=self.t.step(), epoch=self._next_epoch())
        head.batch.index = self.rng.randrange(self.t.micro_batches)
        head.batch.attempt = self._bytes(8)
        head.budget_s = self.rng.choice([1e308, float("inf"), float("nan"), 5.0])
        self.batch = dataclasses.replace(self.batch, index=head.batch.index)
        payload = self._activations()
        return Case("member's replayed micro-batch", request_bytes("micro_batch", head, payload), member=True)

    def float_targets(self) -> Case:
        """A member's well-formed micro-batch whose targets are floats, where the loss takes class
        indices: refused where they are decoded, as its fault (they once reached the last stage's loss)."""
        head = self._head(True, epoch=self._next_epoch())
        self.batch = dataclasses.replace(self.batch, targets=torch.rand(4))
        head.batch.CopyFrom(batch_to_meta(self.batch))
        return Case("member's float targets", request_bytes("micro_batch", head, self._activations()), member=True)

    def averaging_length(self) -> Case:
        """The replicas' all-reduce handler (hivemind's wire format) with an absurd message length."""
        length = self.rng.randint(4 << 20, 1 << 40)
        data = P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(1 << 16)
        return Case("all-reduce's absurd length", data, handler=AVERAGING_HANDLER)

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def stall(self) -> Case:
        """The member's micro-batch, admitted, whose payload stops coming half-way."""
        head, payload = self._head(True), os.urandom(3 << 20)
        whole = request_bytes("micro_batch", head, payload)
        cut = self.rng.randint(len(whole) // 4, len(whole) // 2)
        return Case("stalled stream", whole[:cut], stall=True, member=True)

    def make(self, kind: str) -> Case:
        """A case of `kind` (a name of ROUNDS)."""
        return getattr(self, kind)()


# the kinds of case: (what the fuzz tables call the round of them, its share of the campaign's
# messages, who sends them: "member" when some are the member's), in the order they are sent
# (swarm.bench.fuzz_campaign): the vandal's first (banned at its first, after the floods of
# swarm.bench.fuzz_floods), then the stranger's, then the member's
ROUNDS = {
    "random_bytes": ("random bytes", 1, "vandal"),
    "huge_length": ("absurd message length", 1, "vandal"),
    "big_head": ("oversized head", 1, "vandal"),
    "truncated": ("truncated frame", 1, "stranger"),
    "extended": ("extended frame", 1, "stranger"),
    "stranger_micro_batch": ("stranger's micro-batch", 2, "stranger"),
    "control": ("control calls", 3, "stranger"),
    "zeros_after_refusal": ("zeros after a refusal", 1, "stranger"),
    "averaging_length": ("all-reduce's absurd length", 1, "stranger"),
    "bad_chunks": ("bad chunks", 2, "member"),
    "member_payload": ("member's bad payload", 1, "member"),
    "float_targets": ("member's float targets", 1, "member"),
    "stale_micro_batch": ("member's past micro-batch", 1, "member"),
    "replayed_micro_batch": ("member's replayed micro-batch", 1, "member"),
}
