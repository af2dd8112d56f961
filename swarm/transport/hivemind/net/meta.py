"""What travels with a request besides its activations: the address of the stage it is for, a
micro-batch's place in the schedule (the head's `BatchMeta`), the tensors a micro-batch carries in
its payload (`Carried`: sample ids, targets, stage 0's input) and named tensors (the step's
gradients).

Raw tensors carry dtype and shape and are validated before use: a wrong length or an unknown
dtype is a `ProtocolError`, never a numpy or torch traceback. An integer tensor travels in the
narrowest integer type that holds its values (token ids of a vocabulary under 65,536: uint16, a
quarter of int64's bytes) and is widened back on arrival, so the receiver computes with the very
tensor the sender had.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols import carried as envelope
from protocols import stage_pb2 as pb
from protocols.errors import ProtocolError
from protocols.version import PROTOCOL_VERSION
from swarm.engine.diverged import is_finite
from swarm.engine.microbatch import MicroBatch, Mode

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
# the integer types a tensor may be stored in on the wire, narrowest first (numpy's: torch's uint16 is partial)
_STORED = {name: np.dtype(name) for name in ("uint8", "int8", "uint16", "int16", "int32")}
_INTEGERS = ("int64", "int32", "int16", "int8", "uint8")
MAX_RANK = 8
MAX_ELEMENTS = 1 << 31
MAX_ATTEMPT_BYTES = 16  # a micro-batch attempt's tag (the trainer draws 8)
_MODES = {Mode.TRAIN: pb.TRAIN, Mode.EVAL: pb.EVAL}
_MODES_BACK = {v: k for k, v in _MODES.items()}


def address(run_id: str, stage: int = 0) -> pb.Address:
    return pb.Address(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=stage)


def _narrowest(tensor: torch.Tensor) -> np.dtype | None:
    """The narrowest integer type that holds every value of integer `tensor`, if narrower than its own."""
    if not tensor.numel():
        return None
    low, high = int(tensor.min()), int(tensor.max())
    for stored in _STORED.values():
        info = np.iinfo(stored)
        if stored.itemsize < tensor.element_size() and info.min <= low and high <= info.max:
            return stored
    return None


def tensor_to_raw(tensor: torch.Tensor, narrow: bool = False) -> pb.RawTensor:
    """`tensor` as raw bytes; with `narrow`, an integer tensor in the narrowest type holding its values."""
    tensor = tensor.detach().cpu().contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ProtocolError(f"dtype {name} cannot travel raw (allowed: {', '.join(_DTYPES)})")
    stored = _narrowest(tensor) if narrow and name in _INTEGERS else None
    if stored is not None:
        data = tensor.numpy().astype(stored).tobytes()
        return pb.RawTensor(dtype=name, shape=list(tensor.shape), data=data, stored=stored.name)
    data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return pb.RawTensor(dtype=name, shape=list(tensor.shape), data=data)


def raw_to_tensor(raw: pb.RawTensor, what: str = "tensor") -> torch.Tensor:
    dtype = _DTYPES.get(raw.dtype)
    if dtype is None:
        raise ProtocolError(f"{what}: unknown dtype {raw.dtype!r}")
    if len(raw.shape) > MAX_RANK:  # before a Python loop over a list of any length
        raise ProtocolError(f"{what}: a shape of {len(raw.shape)} dimensions (at most {MAX_RANK})")
    shape = tuple(int(d) for d in raw.shape)
    if any(d < 0 for d in shape):
        raise ProtocolError(f"{what}: bad shape {shape}")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise ProtocolError(f"{what}: {numel} elements exceed the limit {MAX_ELEMENTS}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    stored = None
    if raw.stored:
        stored = _STORED.get(raw.stored)
        if stored is None or raw.dtype not in _INTEGERS or stored.itemsize >= itemsize:
            raise ProtocolError(f"{what}: {raw.dtype} values cannot be stored as {raw.stored!r}")
        itemsize = stored.itemsize
    if len(raw.data) != numel * itemsize:
        raise ProtocolError(
            f"{what}: {len(raw.data)} bytes for shape {shape} of {raw.stored or raw.dtype} (expected {numel * itemsize})"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if stored is not None:
        return torch.from_numpy(np.frombuffer(raw.data, dtype=stored).astype(raw.dtype)).reshape(shape)
    flat = torch.from_numpy(np.frombuffer(bytearray(raw.data), dtype=np.uint8))
    tensor = flat.view(dtype).reshape(shape)
    if not is_finite(tensor):
        raise ProtocolError(f"{what}: values are not finite")
    return tensor


def batch_to_meta(batch: MicroBatch) -> pb.BatchMeta:
    return pb.BatchMeta(
        step=batch.step,
        index=batch.index,
        mode=_MODES[batch.mode],
        weight=batch.weight,
        exact=batch.exact,
        attempt=batch.attempt,
    )


def carried_of(batch: MicroBatch, inputs: torch.Tensor | None = None) -> pb.Carried:
    """What `batch` carries in its payload: its sample ids and targets, and stage 0's `inputs`."""
    carried = pb.Carried(sample_ids=tensor_to_raw(batch.sample_ids, True))
    if inputs is not None:
        carried.inputs.CopyFrom(tensor_to_raw(inputs, True))
    same = inputs is not None and inputs.dtype == batch.targets.dtype and inputs.shape == batch.targets.shape
    if same and torch.equal(inputs.cpu(), batch.targets.cpu()):
        carried.targets_are_inputs = True
    else:
        carried.targets.CopyFrom(tensor_to_raw(batch.targets, True))
    return carried


def micro_batch_payload(batch: MicroBatch, body: bytes = b"", inputs: torch.Tensor | None = None) -> bytes:
    """A micro_batch request's payload (protocols.carried): what `batch` carries, then `body`."""
    return envelope.pack(carried_of(batch, inputs), body)


def meta_to_batch(meta: pb.BatchMeta, carried: pb.Carried) -> MicroBatch:
    """The micro-batch of a head's `meta` and the tensors its payload carried."""
    mode = _MODES_BACK.get(meta.mode)
    if mode is None:
        raise ProtocolError(f"unknown micro-batch mode {meta.mode}")
    ids = raw_to_tensor(carried.sample_ids, "sample ids")
    if carried.targets_are_inputs and carried.HasField("targets"):
        raise ProtocolError("targets sent as well as said to equal the inputs")
    targets = raw_to_tensor(carried.inputs if carried.targets_are_inputs else carried.targets, "targets")
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ProtocolError(f"sample ids must be a 1-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    if targets.dim() == 0 or targets.shape[0] != ids.numel():
        raise ProtocolError(f"targets of shape {tuple(targets.shape)} do not match {ids.numel()} sample ids")
    if not math.isfinite(meta.weight) or meta.weight < 0:
        raise ProtocolError(f"bad micro-batch weight {meta.weight}")
    if len(meta.attempt) > MAX_ATTEMPT_BYTES:
        raise ProtocolError(f"a micro-batch attempt of {len(meta.attempt)} bytes (at most {MAX_ATTEMPT_BYTES})")
    return MicroBatch(
        int(meta.step), int(meta.index), ids, targets, mode, float(meta.weight), bool(meta.exact), bytes(meta.attempt)
    )


def tensors_to_payload(named: dict[str, torch.Tensor]) -> tuple[list[pb.TensorSlot], bytes]:
    """Several tensors in one payload (step exchanges): slots plus concatenated bytes."""
    slots, parts, offset = [], [], 0
    for name, tensor in named.items():
        raw = tensor_to_raw(tensor)
        slots.append(pb.TensorSlot(name=name, dtype=raw.dtype, shape=raw.shape, offset=offset, length=len(raw.data)))
        parts.append(raw.data)
        offset += len(raw.data)
    return slots, b"".join(parts)


def payload_to_tensors(slots, payload: bytes) -> dict[str, torch.Tensor]:
    out = {}
    for slot in slots:
        if slot.offset + slot.length > len(payload):
            raise ProtocolError(f"tensor {slot.name!r} runs past the end of the payload")
        raw = pb.RawTensor(dtype=slot.dtype, shape=slot.shape, data=payload[slot.offset : slot.offset + slot.length])
        out[slot.name] = raw_to_tensor(raw, f"tensor {slot.name!r}")
    return out
