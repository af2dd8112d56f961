"""Error-feedback state: one global buffer per tensor shape, or one row per sample id.

Tables hand out fp32 copies and store what they are given in their own format, so what both
ends of a link read back is bit-identical. Versions count committed updates: every payload
carries the versions it was computed against, and commits check them (nothing double-commits).

`SampleStore` keeps AQ-SGD / per-sample EF buffers in a compact row format (fp32, fp16, bf16 or
k-bit with a per-sample range), in memory or in a disk-backed memmap, and reports its bytes.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from protocols import bitpack
from protocols.message import Granularity, QuantPart
from swarm.compression.quantize import dequantize, quantize


class StaleStateError(RuntimeError):
    """A pending update was computed against state that has changed since."""


class StoreFullError(RuntimeError):
    """A disk-backed store has no free slot for a new sample."""


_FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STORE_FORMATS = "fp32, fp16, bf16 or q1..q8"


def check_store_format(fmt: str) -> str:
    if fmt in _FLOAT_FORMATS or re.fullmatch(r"q[1-8]", fmt):
        return fmt
    raise ValueError(f"unknown state store format {fmt!r}; use {STORE_FORMATS}")


@dataclass(frozen=True)
class RowFormat:
    """How one sample's buffer of `numel` values is laid out in bytes."""

    fmt: str
    numel: int

    @property
    def bits(self) -> int | None:
        return int(self.fmt[1:]) if self.fmt.startswith("q") else None

    @property
    def row_bytes(self) -> int:
        if self.bits is None:
            return self.numel * _FLOAT_FORMATS[self.fmt].itemsize
        return bitpack.packed_length(self.numel, self.bits) + 8  # + fp32 low and step

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, numel] float -> [B, row_bytes] uint8."""
        if self.numel == 0 or rows.shape[0] == 0:
            return torch.zeros((rows.shape[0], self.row_bytes), dtype=torch.uint8)
        if self.bits is None:
            return rows.to(_FLOAT_FORMATS[self.fmt]).contiguous().view(torch.uint8)
        part = quantize(rows, self.bits, Granularity.SAMPLE)
        codes = bitpack.pack(part.codes.view(rows.shape[0], self.numel), self.bits)
        ranges = torch.stack([part.lows, part.steps], dim=1).contiguous().view(torch.uint8)
        return torch.cat([codes, ranges], dim=1)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """[B, row_bytes] uint8 -> [B, numel] float32."""
        if self.numel == 0 or raw.shape[0] == 0:
            return torch.zeros((raw.shape[0], self.numel), dtype=torch.float32)
        if self.bits is None:
            return raw.reshape(-1).clone().view(_FLOAT_FORMATS[self.fmt]).view(raw.shape[0], -1).float()
        ranges = raw[:, -8:].reshape(-1).clone().view(torch.float32).view(-1, 2)  # a copy: views need alignment
        codes = bitpack.unpack(raw[:, :-8], self.bits, self.numel)
        part = QuantPart(
            self.bits, Granularity.SAMPLE, codes.reshape(-1), ranges[:, 0].contiguous(), ranges[:, 1].contiguous()
        )
        return dequantize(part, (raw.shape[0], self.numel), torch.float32, raw.device)


class GlobalState:
    """One buffer per tensor shape (the paper's 'global error buffer'), kept in fp32."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}

    def load(self, shape: tuple[int, ...], ids, device) -> tuple[torch.Tensor, tuple[int, ...]]:
        buf, version = self._buffers.get(shape, (None, 0))
        if buf is None:
            return torch.zeros(shape, dtype=torch.float32, device=device), (0,)
        return buf.to(device, copy=True), (version,)

    def save(self, ids, values: torch.Tensor, versions: tuple[int, ...]) -> torch.Tensor:
        self._buffers[tuple(values.shape)] = (values.detach().float().clone(), versions[0])
        return values

    def versions(self, shape: tuple[int, ...], ids) -> tuple[int, ...]:
        return (self._buffers.get(shape, (None, 0))[1],)

    def reset(self) -> None:
        self._buffers.clear()

    def state_dict(self) -> dict:
        """The buffers and their versions (plain tensors and ints: a checkpoint)."""
        return {
            "kind": "global",
            "buffers": [
                {"shape": list(shape), "values": buf.cpu().clone(), "version": int(version)}
                for shape, (buf, version) in self._buffers.items()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "global":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} state table, this link keeps a global one")
        self._buffers = {tuple(b["shape"]): (b["values"].float().clone(), int(b["version"])) for b in state["buffers"]}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())


class SampleStore:
    """One buffer row per sample id, in a compact format, in memory or on disk.

    `path` makes it disk-backed (a memmap of `capacity` rows, created on first use); in memory
    it grows as samples arrive. All rows of a store share one shape.
    """

    def __init__(self, fmt: str = "q6", path: str | os.PathLike | None = None, capacity: int | None = None) -> None:
        self.fmt = check_store_format(fmt)
        if path is not None and not capacity:
            raise ValueError("a disk-backed state store needs a capacity (the number of samples)")
        self.path = path
        self.capacity = capacity
        self._row_shape: tuple[int, ...] | None = None
        self._format: RowFormat | None = None
        self._rows: torch.Tensor | None = None  # [slots, row_bytes] uint8
        self._versions: torch.Tensor | None = None  # [slots] int64
        self._slots: dict[int, int] = {}

    # -- layout --

    def _ensure(self, row_shape: tuple[int, ...], needed: int) -> None:
        if self._row_shape is None:
            self._row_shape = row_shape
            self._format = RowFormat(self.fmt, math.prod(row_shape))
            if self.path is not None:
                mm = np.lib.format.open_memmap(
                    self.path, mode="w+", dtype=np.uint8, shape=(self.capacity, self._format.row_bytes)
                )
                self._rows = torch.from_numpy(mm)
                self._versions = torch.zeros(self.capacity, dtype=torch.long)
            else:
                self._rows = torch.empty((0, self._format.row_bytes), dtype=torch.uint8)
                self._versions = torch.zeros(0, dtype=torch.long)
        elif row_shape != self._row_shape:
            raise ValueError(f"state store holds samples of shape {self._row_shape}, got {row_shape}")
        if needed > self._rows.shape[0]:
            if self.path is not None:
                raise StoreFullError(
                    f"state store is full ({self.capacity} samples); raise its capacity to the dataset size"
                )
            grow = max(needed, 2 * self._rows.shape[0], 16)
            rows = torch.empty((grow, self._format.row_bytes), dtype=torch.uint8)
            rows[: self._rows.shape[0]] = self._rows
            versions = torch.zeros(grow, dtype=torch.long)
            versions[: self._versions.shape[0]] = self._versions
            self._rows, self._versions = rows, versions

    def _lookup(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([self._slots.get(i, -1) for i in ids], dtype=torch.long)

    # -- table interface --

    def load(self, shape: tuple[int, ...], ids: list[int], device) -> tuple[torch.Tensor, tuple[int, ...]]:
        out = torch.zeros((len(ids), math.prod(shape[1:])), dtype=torch.float32)
        if not ids:
            return out.view(shape).to(device), ()
        versions = [0] * len(ids)
        if self._rows is not None and self._slots:
            if tuple(shape[1:]) != self._row_shape:
                raise ValueError(f"state store holds samples of shape {self._row_shape}, got {tuple(shape[1:])}")
            slots = self._lookup(ids)
            known = (slots >= 0).nonzero().squeeze(1)
            if known.numel():
                out[known] = self._format.decode(self._rows[slots[known]])
                versions = self._versions[slots.clamp(min=0)].masked_fill(slots < 0, 0).tolist()
        return out.view(shape).to(device), tuple(versions)

    def save(self, ids: list[int], values: torch.Tensor, versions: tuple[int, ...]) -> torch.Tensor:
        """Store rows; returns what reading them back gives."""
        if not ids:
            return values
        rows = values.detach().reshape(len(ids), -1).float().cpu()
        new = [i for i in ids if i not in self._slots]
        self._ensure(tuple(values.shape[1:]), len(self._slots) + len(set(new)))
        for i in new:
            self._slots.setdefault(i, len(self._slots))
        slots = self._lookup(ids)
        raw = self._format.encode(rows)
        self._rows[slots] = raw
        self._versions[slots] = torch.tensor(versions, dtype=torch.long)
        return self._format.decode(raw).view(values.shape).to(values.device)

    def versions(self, shape: tuple[int, ...], ids: list[int]) -> tuple[int, ...]:
        if not self._slots:
            return (0,) * len(ids)
        slots = self._lookup(ids)
        return tuple(self._versions[slots.clamp(min=0)].masked_fill(slots < 0, 0).tolist())

    def reset(self) -> None:
        self._slots.clear()
        if self._versions is not None:
            self._versions.zero_()

    def _rows_crc(self, n: int) -> int:
        return zlib.crc32(self._rows[:n].numpy().tobytes()) if n else 0

    def state_dict(self) -> dict:
        """Slots, versions and (in memory) rows. A disk-backed store's rows stay in its memmap
        file; the checkpoint keeps their crc32, so loading refuses rows changed since."""
        n = len(self._slots)
        ids = sorted(self._slots, key=self._slots.get)  # slot order: ids[slot] is the sample id
        state = {
            "kind": "samples",
            "fmt": self.fmt,
            "row_shape": None if self._row_shape is None else list(self._row_shape),
            "ids": torch.tensor(ids, dtype=torch.long),
            "versions": torch.zeros(0, dtype=torch.long) if self._versions is None else self._versions[:n].clone(),
            "path": None if self.path is None else str(self.path),
        }
        if self.path is None:
            state["rows"] = None if self._rows is None else self._rows[:n].clone()
        else:
            state["rows_crc32"] = self._rows_crc(n) if self._rows is not None else 0
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "samples":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} state table, this link keeps per-sample rows")
        if state["fmt"] != self.fmt:
            raise ValueError(f"checkpoint stores rows as {state['fmt']}, this store as {self.fmt}")
        ids = [int(i) for i in state["ids"].tolist()]
        self._slots, self._row_shape, self._format, self._rows, self._versions = {}, None, None, None, None
        if state["row_shape"] is None:
            return
        row_shape = tuple(state["row_shape"])
        if self.path is None:
            self._ensure(row_shape, len(ids))
            self._rows[: len(ids)] = state["rows"]
        else:
            self._row_shape, self._format = row_shape, RowFormat(self.fmt, math.prod(row_shape))
            if not os.path.exists(self.path):
                raise FileNotFoundError(
                    f"the disk-backed state store {self.path} is gone; its rows are not in the checkpoint"
                )
            mm = np.lib.format.open_memmap(self.path, mode="r+")
            if mm.shape != (self.capacity, self._format.row_bytes) or mm.dtype != np.uint8:
                raise ValueError(
                    f"state store {self.path} holds {mm.shape} {mm.dtype}, expected ({self.capacity}, {self._format.row_bytes}) uint8"
                )
            self._rows = torch.from_numpy(mm)
            self._versions = torch.zeros(self.capacity, dtype=torch.long)
            if self._rows_crc(len(ids)) != state.get("rows_crc32", 0):
                raise ValueError(
                    f"the rows in {self.path} changed since this checkpoint (disk-backed stores keep rows in place: only the newest checkpoint can resume)"
                )
        self._versions[: len(ids)] = state["versions"]
        self._slots = {i: slot for slot, i in enumerate(ids)}

    @property
    def samples(self) -> int:
        return len(self._slots)

    @property
    def bytes_per_sample(self) -> int:
        return self._format.row_bytes + 8 if self._format else 0

    @property
    def nbytes(self) -> int:
        """Bytes the stored samples take (rows plus their versions)."""
        return self.samples * self.bytes_per_sample
