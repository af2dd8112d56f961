"""One micro-batch's trip through a stage peer, as the chain (stage.chain) runs it: what its steps
(admission, forward, the downstream call, backward) hand each other, and the checks of what its
sender sent, each of them that sender's fault when it fails (`SenderFault`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from protocols import carried as envelope
from protocols import stage_pb2 as pb
from protocols.errors import PayloadError, ProtocolError, SenderFault
from swarm.engine.microbatch import Kind, MicroBatch, Mode
from swarm.engine.precision import activation_dtypes
from swarm.tracing import TRACER, wall
from swarm.transport.hivemind.net.meta import meta_to_batch, raw_to_tensor
from swarm.transport.hivemind.stage.state import StagePlace


@dataclass
class Outcome:
    """A processed micro-batch: the reply for the caller."""

    kind: Kind
    payload: bytes = b""
    metrics: dict[str, float] = field(default_factory=dict)
    route: list[str] = field(default_factory=list)
    evidence: list = field(default_factory=list)  # signed accounts of the attempt (stage.hop_evidence)
    exponents: list[bytes] = field(default_factory=list)  # a training micro-batch's, per peer of `route`


@dataclass(eq=False, slots=True)
class Trip:
    """One micro-batch on its way through this stage (by reference: nothing of its payload is
    copied). The trip is also its attempt's identity: a newer attempt of the same micro-batch takes
    over its runtime state here (`Chain.attempts`)."""

    head: pb.MicroBatchHead
    sender: str
    batch: MicroBatch
    carried: pb.Carried
    body: memoryview  # its activations (stage 0: none)
    deadline: float  # monotonic: what its sender waits, less a margin
    used: list = field(default_factory=lambda: [None, None])  # the link ends it computed with (in, out)
    started: float = 0.0  # perf_counter when it was first admitted in link order
    ticket: object = None  # its place in the backward order (`Ordinals`), a training one sent downstream
    # train.verify (stage.hop_evidence): the activations sent on, the SHA-256s of the payloads exchanged
    # with the next stage (sent, its reply), and its stage's and later stages' signed accounts
    body_out: bytes = b""
    avoid: frozenset = frozenset()  # next-stage peers the owner's check tokens named (Handoff.avoided)
    hashes: tuple = (b"", b"")
    downstream: list = field(default_factory=list)


def check_dtype(dtype: torch.dtype, precision: str) -> None:
    """A payload declaring activations of a dtype no stage of this run gives is its sender's fault
    (an fp16 payload in an fp32 run would pass as exact values and fail stages further on)."""
    allowed = activation_dtypes(precision)
    if dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise PayloadError(f"activations in {str(dtype).removeprefix('torch.')}: this run's stages send {names}")


def budget(declared: float, most: float) -> float:
    """The seconds a micro-batch may take here: what its sender says it waits, never more than any
    caller of ours waits (a member's 1e308 would park its payload for good), the most when unsaid
    or not a number."""
    if not (math.isfinite(declared) and declared > 0):
        return most
    return min(declared, most)


def unpack(head: pb.MicroBatchHead, payload: bytes, targets) -> tuple[MicroBatch, pb.Carried, memoryview]:
    """The micro-batch of `head` and its payload, what it carries and a view of its activations;
    a malformed payload, or targets its loss does not take (`targets`: swarm.models.base.Targets,
    None: not known), are its sender's fault."""
    try:
        carried, body = envelope.unpack(payload)
        batch = meta_to_batch(head.batch, carried)
    except (PayloadError, ProtocolError) as e:
        raise SenderFault(str(e)) from None
    if targets is not None and (problem := targets.problem(batch.targets, batch.mode is Mode.EVAL)) is not None:
        raise SenderFault(f"targets: {problem}")
    return batch, carried, body


def stage_inputs(carried: pb.Carried, body: memoryview):
    """Stage 0's input: carried, with no activations after it."""
    if not carried.HasField("inputs") or len(body):
        raise SenderFault("a micro-batch for stage 0 carries its input and nothing after it")
    try:
        return raw_to_tensor(carried.inputs, "stage 0 input")
    except ProtocolError as e:
        raise SenderFault(str(e)) from None


_MODES = {pb.TRAIN: "train", pb.EVAL: "eval"}


def trace_exchange(place: StagePlace, head: pb.MicroBatchHead, sender: str, times, size: int, reply: int) -> None:
    """A micro-batch exchange as its callee saw it: the request arriving (`times`: its first byte and
    its whole, monotonic), the wait for a send slot and the reply leaving (wall seconds), and when
    the request began to arrive and the reply began to leave, which swarm.timeline pairs with the
    caller's times to align the two clocks."""
    started, arrived, waited, began = times
    label = f"{_MODES.get(head.batch.mode, '?')}/{head.batch.step}/{head.batch.index}"
    who = "trainer" if place.first else f"stage{place.stage - 1}"
    TRACER.add("receive", f"receive from {who} {sender[-4:]}", wall(started), wall(arrived), mb=label, bytes=size)
    TRACER.add("wait: send slot", "wait", waited, began, mb=label)
    done = time.time()
    TRACER.add("send reply", f"send to {who} {sender[-4:]}", began, done, mb=label, bytes=reply)
    TRACER.exchange("callee", sender, f"{label}/{head.epoch}/{head.seq}", wall(started), began)
