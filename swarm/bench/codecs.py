"""`python -m swarm bench codecs`: bits per element, error and speed of every codec.

Bits come from the serialized payload (what would cross the network). Speeds are MB/s of the
fp32 input through encode (math + serialization to bytes) and decode (parsing, validation and
math), the median of several repeats. Reference rows time hivemind's FLOAT16 codec through the
same steps and torch.topk alone.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.bench.tensors import activation_gradient, benchmark_tensors
from swarm.compression import parse
from swarm.compression.spec import DEFAULT_STORE
from swarm.compression.state import SampleStore
from swarm.compression.topk import kept_per_sample

CODECS = (
    "none",
    "fp16",
    "bf16",
    "quant:8",
    "quant:6",
    "quant:4",
    "quant:4/tensor",
    "quant:4/channel",
    "quant:3",
    "quant:2",
    "quant:1",
    "topk:0.5/fp16",
    "topk:0.1",
    "topk:0.1/fp16",
    "topk:0.1/q8",
    "topk:0.05/fp16",
    "topk:reuse/fp16",
)
STORE_FORMATS = ("fp32", "fp16", "q8", "q6", "q4")
CIFAR_TRAIN_SAMPLES = 50_000


@dataclass
class Row:
    codec: str
    tensor: str
    bits_per_element: float | None
    rel_error: float | None
    encode_mbps: float | None
    decode_mbps: float | None
    extra: dict | None = None

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra or {})
        return d


def _median_seconds(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median wall time of `repeat` calls after one warm-up call (whose result is returned)."""
    result = fn()  # warm-up, also the result we report on
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    norm = float(x.float().norm())
    return float((x.float() - y.float()).norm()) / norm if norm else 0.0


def _mbps(x: torch.Tensor, seconds: float) -> float:
    return x.numel() * 4 / 1e6 / seconds


def codec_row(name: str, x: torch.Tensor, spec: str, repeat: int) -> Row:
    parsed = parse(spec)
    reuse = None
    target = x
    if parsed.reuses_indices:  # a gradient sent back at the activation's TopK positions
        forward = parse("topk:0.1/fp16").sender().send(x)
        reuse = forward.selection
        target = activation_gradient(tuple(x.shape), torch.Generator().manual_seed(1))
    sender, receiver = parsed.sender(), parsed.receiver()
    enc_s, out = _median_seconds(lambda: sender.send(target, reuse=reuse), repeat)
    dec_s, inc = _median_seconds(lambda: receiver.receive(out.payload, reuse=reuse), repeat)
    bits = len(out.payload) * 8 / x.numel()
    return Row(spec, name, bits, _rel_error(target, inc.tensor), _mbps(x, enc_s), _mbps(x, dec_s))


def hivemind_float16_row(name: str, x: torch.Tensor, repeat: int) -> Row:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    def encode() -> bytes:
        return serialize_torch_tensor(x, runtime_pb2.CompressionType.FLOAT16).SerializeToString()

    enc_s, payload = _median_seconds(encode, repeat)

    def decode() -> torch.Tensor:
        return deserialize_torch_tensor(runtime_pb2.Tensor.FromString(payload))

    dec_s, y = _median_seconds(decode, repeat)
    return Row("hivemind:float16", name, len(payload) * 8 / x.numel(), _rel_error(x, y), _mbps(x, enc_s), _mbps(x, dec_s))


def torch_topk_row(name: str, x: torch.Tensor, repeat: int, ratio: float = 0.1) -> Row:
    rows = x.shape[0]
    flat = x.reshape(rows, -1)
    k = kept_per_sample(ratio, flat.shape[1])
    enc_s, _ = _median_seconds(lambda: torch.topk(flat.abs(), k, dim=1, sorted=False), repeat)
    return Row(f"torch:topk:{ratio:g}", name, None, None, _mbps(x, enc_s), None)


def store_row(name: str, x: torch.Tensor, fmt: str, repeat: int) -> Row:
    """AQ-SGD buffer: bytes per sample in this format, and what storing costs in accuracy."""
    ids = list(range(x.shape[0]))
    store = SampleStore(fmt)
    save_s, _ = _median_seconds(lambda: store.save(ids, x, (1,) * len(ids)), repeat)
    load_s, (y, _) = _median_seconds(lambda: store.load(tuple(x.shape), ids, x.device), repeat)
    per_sample_fp32 = math.prod(x.shape[1:]) * 4
    fraction = store.bytes_per_sample / per_sample_fp32
    extra = {
        "kind": "aqsgd_store",
        "bytes_per_sample": store.bytes_per_sample,
        "fraction_of_fp32": fraction,
        "gb_for_50k_samples": store.bytes_per_sample * CIFAR_TRAIN_SAMPLES / 1e9,
    }
    bits = store.bytes_per_sample * 8 / math.prod(x.shape[1:])
    return Row(f"aqsgd-store:{fmt}", name, bits, _rel_error(x, y), _mbps(x, save_s), _mbps(x, load_s), extra)


def run(scale: float = 1.0, repeat: int = 3, progress: bool = True) -> list[Row]:
    from tqdm import tqdm

    tensors = benchmark_tensors(scale)
    jobs: list[tuple[str, Callable[[], Row]]] = []
    for name, x in tensors.items():
        jobs.append(("hivemind:float16", lambda n=name, t=x: hivemind_float16_row(n, t, repeat)))
        jobs.append(("torch:topk:0.1", lambda n=name, t=x: torch_topk_row(n, t, repeat)))
        for spec in CODECS:
            jobs.append((spec, lambda n=name, t=x, s=spec: codec_row(n, t, s, repeat)))
        if name.startswith("resnet18.layer1"):
            for fmt in STORE_FORMATS:
                jobs.append((f"aqsgd-store:{fmt}", lambda n=name, t=x, f=fmt: store_row(n, t, f, repeat)))
    rows = []
    bar = tqdm(jobs, desc="bench codecs", unit="row", disable=not progress, leave=False)
    for label, job in bar:
        bar.set_postfix_str(label)
        rows.append(job())
    return rows




# ---- targets and printing -------------------------------------------------------------------------


def _index(rows: list[Row]) -> dict[tuple[str, str], Row]:
    return {(r.codec, r.tensor): r for r in rows}


def _round_trip_seconds(row: Row) -> float:
    return 1 / row.encode_mbps + 1 / row.decode_mbps  # seconds per MB, encode then decode


def targets(rows: list[Row]) -> list[tuple[str, str, bool]]:
    """The issue's figures to reach: (what, measured, met) per tensor."""
    by = _index(rows)
    out = []
    for tensor in dict.fromkeys(r.tensor for r in rows):
        ref = by.get(("hivemind:float16", tensor))
        topk_ref = by.get(("torch:topk:0.1", tensor))
        if (r := by.get(("topk:0.1/fp16", tensor))) is not None:
            out.append((f"{tensor}: topk:0.1/fp16 <= 2.7 bits/elem", f"{r.bits_per_element:.3f}", r.bits_per_element <= 2.7))
        if (r := by.get(("topk:reuse/fp16", tensor))) is not None:
            out.append((f"{tensor}: topk:reuse/fp16 <= 1.7 bits/elem", f"{r.bits_per_element:.3f}", r.bits_per_element <= 1.7))
        for r in rows:  # the default (per-sample) quantizer; /tensor and /channel rows are informative
            if r.tensor != tensor or not r.codec.startswith("quant:") or "/" in r.codec:
                continue
            bits = int(r.codec.split(":")[1].split("/")[0])
            out.append((f"{tensor}: {r.codec} <= {bits + 0.1:g} bits/elem", f"{r.bits_per_element:.3f}", r.bits_per_element <= bits + 0.1))
            if ref is not None:
                ratio = _round_trip_seconds(ref) / _round_trip_seconds(r)
                out.append((f"{tensor}: {r.codec} enc+dec speed >= hivemind:float16", f"{ratio:.2f}x", ratio >= 1.0))
        if (r := by.get(("topk:0.1", tensor))) is not None and topk_ref is not None:
            ratio = _round_trip_seconds(r) / (1 / topk_ref.encode_mbps)
            out.append((f"{tensor}: topk:0.1 enc+dec time <= 1.5x torch.topk", f"{ratio:.2f}x", ratio <= 1.5))
        for r in rows:
            if r.tensor == tensor and r.extra and r.codec == f"aqsgd-store:{DEFAULT_STORE}":
                frac = r.extra["fraction_of_fp32"]
                out.append((f"{tensor}: {r.codec} memory <= 25% of fp32", f"{100 * frac:.2f}%", frac <= 0.25))
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: list[Row]) -> str:
    lines = [f"{'tensor':34s} {'codec':22s} {'bits/elem':>9s} {'rel.err':>9s} {'enc MB/s':>9s} {'dec MB/s':>9s}"]
    for r in rows:
        lines.append(
            f"{r.tensor:34s} {r.codec:22s} {_fmt(r.bits_per_element, '9.3f')} {_fmt(r.rel_error, '9.2e')} "
            f"{_fmt(r.encode_mbps, '9.0f')} {_fmt(r.decode_mbps, '9.0f')}"
        )
    stores = [r for r in rows if r.extra]
    if stores:
        lines.append("")
        lines.append(f"AQ-SGD buffers for {CIFAR_TRAIN_SAMPLES:,} CIFAR-10 samples at the layer1 boundary (per side, per boundary):")
        for r in stores:
            e = r.extra
            lines.append(f"  {r.codec:20s} {e['bytes_per_sample']:>8,d} B/sample  {100 * e['fraction_of_fp32']:6.2f}% of fp32  {e['gb_for_50k_samples']:6.2f} GB")
    return "\n".join(lines)


def format_targets(checks: list[tuple[str, str, bool]]) -> str:
    lines = ["targets:"]
    for what, value, ok in checks:
        lines.append(f"  [{'ok' if ok else 'MISSED'}] {what}: {value}")
    return "\n".join(lines)
