"""`python -m swarm bench codecs`: bits per element, error and speed of every codec.

Bits come from the serialized payload (what would cross the network). Speeds are MB/s of the
fp32 input through encode (math + serialization to bytes) and decode (parsing, validation and
math), the median of several repeats. Reference rows time hivemind's FLOAT16 codec through the
same steps and torch.topk alone; on the [tokens x hidden] tensors, the low-rank codecs are set
against torch.svd_lowrank (the same kind of randomized factorization) and torch.linalg.svd cut to
the same rank (the best error any rank-R message can have), each timed as factorization
("encode") and product ("decode"), with no payload. Subspace rows send a message in a basis both
ends already hold, installed from another micro-batch of the same boundary (`next_batch`); their
`refresh` rows send the message that finds and carries a new basis (once every K), and `extra`
gives the bits per element amortized over K messages. Warm low-rank rows (`/warm`) encode from a
sender whose last delivered message was that other micro-batch (each repeat from that same start).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from tqdm import tqdm

from protocols import wire
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
LOW_RANK_CODECS = ("lowrank:8", "lowrank:32", "lowrank:32/q8", "lowrank:32/fp32")
WARM_CODECS = ("lowrank:8/warm", "lowrank:32/warm", "lowrank:32/q8/warm")  # beside their plain rows
SUBSPACE_CODECS = ("subspace:8", "subspace:32", "subspace:32/q8")
REFRESH = " refresh"  # the row of a subspace codec's basis-carrying message
LOW_RANK_REFERENCE = 32  # the rank of the torch.linalg rows
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


@dataclass
class Probe:
    """One row to measure: encode() -> out, decode(out) -> result, and what to report of them."""

    codec: str
    tensor: str
    x: torch.Tensor
    encode: Callable[[], object]
    decode: Callable[[object], object] | None
    report: Callable[[object, object], tuple[float | None, float | None, dict | None]]
    encode_times: list[float] = field(default_factory=list)
    decode_times: list[float] = field(default_factory=list)

    def once(self) -> tuple[object, object]:
        start = time.perf_counter()
        out = self.encode()
        middle = time.perf_counter()
        result = self.decode(out) if self.decode is not None else None
        end = time.perf_counter()
        self.encode_times.append(middle - start)
        self.decode_times.append(end - middle)
        return out, result

    def row(self, out: object, result: object) -> Row:
        bits, error, extra = self.report(out, result)
        enc = _mbps(self.x, statistics.median(self.encode_times))
        dec = _mbps(self.x, statistics.median(self.decode_times)) if self.decode is not None else None
        return Row(self.codec, self.tensor, bits, error, enc, dec, extra)


def _rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    norm = float(x.float().norm())
    return float((x.float() - y.float()).norm()) / norm if norm else 0.0


def _mbps(x: torch.Tensor, seconds: float) -> float:
    return x.numel() * 4 / 1e6 / seconds


def codec_probe(name: str, x: torch.Tensor, spec: str, prior: torch.Tensor | None = None) -> Probe:
    """`prior`: a tensor the sender delivered first (a warm low-rank sender's start); the timed
    messages are never committed, so each repeat starts from it."""
    parsed = parse(spec)
    reuse = None
    target = x
    if parsed.reuses_indices:  # a gradient sent back at the activation's TopK positions
        reuse = parse("topk:0.1/fp16").sender().send(x).selection
        target = activation_gradient(tuple(x.shape), torch.Generator().manual_seed(1))
    sender, receiver = parsed.sender(), parsed.receiver()
    if prior is not None:
        sender.send(prior).commit()
    return Probe(
        spec,
        name,
        x,
        lambda: sender.send(target, reuse=reuse).payload,
        lambda payload: receiver.receive(wire.decode(payload), reuse=reuse).tensor,
        lambda payload, y: (len(payload) * 8 / x.numel(), _rel_error(target, y), None),
    )


def subspace_probes(name: str, x: torch.Tensor, prior: torch.Tensor, spec: str) -> list[Probe]:
    """A message in a held basis (installed from `prior`, another micro-batch) and a refresh."""
    parsed = parse(spec)
    every = parsed.codec.every
    sender, receiver = parsed.sender(), parsed.receiver()
    first = sender.send(prior)
    receiver.receive(wire.decode(first.payload)).commit()
    first.commit()
    fresh = parsed.sender()  # never committed: every message finds and carries a basis
    sizes = {}

    def report(kind: str):
        def bits(payload, y):
            sizes[kind] = len(payload)
            extra = None
            if len(sizes) == 2:  # both rows measured: the cost over K messages of one basis
                mean = (sizes["refresh"] + (every - 1) * sizes["held"]) / every
                extra = {"every": every, "amortized_bits_per_element": mean * 8 / x.numel()}
            return len(payload) * 8 / x.numel(), _rel_error(x, y), extra

        return bits

    return [
        Probe(
            spec,
            name,
            x,
            lambda: sender.send(x).payload,
            lambda payload: receiver.receive(wire.decode(payload)).tensor,
            report("held"),
        ),
        Probe(
            spec + REFRESH,
            name,
            x,
            lambda: fresh.send(x).payload,
            lambda payload: parsed.receiver().receive(wire.decode(payload)).tensor,
            report("refresh"),
        ),
    ]


def hivemind_float16_probe(name: str, x: torch.Tensor) -> Probe:
    return Probe(
        "hivemind:float16",
        name,
        x,
        lambda: serialize_torch_tensor(x, runtime_pb2.CompressionType.FLOAT16).SerializeToString(),
        lambda payload: deserialize_torch_tensor(runtime_pb2.Tensor.FromString(payload)),
        lambda payload, y: (len(payload) * 8 / x.numel(), _rel_error(x, y), None),
    )


def torch_topk_probe(name: str, x: torch.Tensor, ratio: float = 0.1) -> Probe:
    flat = x.reshape(x.shape[0], -1)
    k = kept_per_sample(ratio, flat.shape[1])
    return Probe(
        f"torch:topk:{ratio:g}",
        name,
        x,
        lambda: torch.topk(flat.abs(), k, dim=1, sorted=False),
        None,
        lambda out, y: (None, None, None),
    )


def _factors_probe(codec: str, name: str, x: torch.Tensor, factorize: Callable) -> Probe:
    """A torch factorization of x as a [rows, last dim] matrix: factorize -> (u, s, v), decode u s v^T."""
    m = x.reshape(-1, x.shape[-1])
    return Probe(
        codec,
        name,
        x,
        lambda: factorize(m),
        lambda usv: (usv[0] * usv[1]) @ usv[2].T,
        lambda usv, y: (None, _rel_error(m, y), None),
    )


def torch_low_rank_probes(name: str, x: torch.Tensor, rank: int = LOW_RANK_REFERENCE) -> list[Probe]:
    def truncated_svd(m):
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank].T

    return [
        _factors_probe(f"torch:svd_lowrank:{rank}", name, x, lambda m: torch.svd_lowrank(m, q=rank, niter=2)),
        _factors_probe(f"torch:linalg.svd:{rank}", name, x, truncated_svd),
    ]


def store_probe(name: str, x: torch.Tensor, fmt: str) -> Probe:
    """AQ-SGD buffer: bytes per sample in this format, and what storing costs in accuracy."""
    ids = list(range(x.shape[0]))
    store = SampleStore(fmt)
    per_sample = math.prod(x.shape[1:])

    def report(out, loaded):
        extra = {
            "kind": "aqsgd_store",
            "bytes_per_sample": store.bytes_per_sample,
            "fraction_of_fp32": store.bytes_per_sample / (per_sample * 4),
            "gb_for_50k_samples": store.bytes_per_sample * CIFAR_TRAIN_SAMPLES / 1e9,
        }
        return store.bytes_per_sample * 8 / per_sample, _rel_error(x, loaded[0]), extra

    return Probe(
        f"aqsgd-store:{fmt}",
        name,
        x,
        lambda: store.save(ids, x, (1,) * len(ids)),
        lambda out: store.load(tuple(x.shape), ids, x.device),
        report,
    )


def run(scale: float = 1.0, repeat: int = 3, progress: bool = True) -> list[Row]:
    """Measure every probe of a tensor in rounds, so load changes hit all rows alike."""
    tensors = benchmark_tensors(scale)
    priors = benchmark_tensors(scale, next_batch=True)
    rows = []
    bar = tqdm(total=len(tensors) * (repeat + 1), desc="bench codecs", unit="round", disable=not progress, leave=False)
    for name, x in tensors.items():
        probes = [hivemind_float16_probe(name, x), torch_topk_probe(name, x)]
        probes += [codec_probe(name, x, spec) for spec in CODECS]
        if name.startswith("gpt2."):  # [tokens x hidden]: what the low-rank codecs are for
            probes += [codec_probe(name, x, spec) for spec in LOW_RANK_CODECS] + torch_low_rank_probes(name, x)
            probes += [codec_probe(name, x, spec, priors[name]) for spec in WARM_CODECS]
            probes += [p for spec in SUBSPACE_CODECS for p in subspace_probes(name, x, priors[name], spec)]
        if name.startswith("resnet18.layer1"):
            probes += [store_probe(name, x, fmt) for fmt in STORE_FORMATS]
        results = [p.once() for p in probes]  # warm-up; also what rows report on
        for p in probes:
            p.encode_times.clear()
            p.decode_times.clear()
        bar.update(1)
        for _ in range(repeat):
            for p in probes:
                p.once()
            bar.update(1)
        rows += [p.row(*result) for p, result in zip(probes, results, strict=True)]
    bar.close()
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
            out.append(
                (f"{tensor}: topk:0.1/fp16 <= 2.7 bits/elem", f"{r.bits_per_element:.3f}", r.bits_per_element <= 2.7)
            )
        if (r := by.get(("topk:reuse/fp16", tensor))) is not None:
            out.append(
                (f"{tensor}: topk:reuse/fp16 <= 1.7 bits/elem", f"{r.bits_per_element:.3f}", r.bits_per_element <= 1.7)
            )
        for r in rows:  # the default (per-sample) quantizer; /tensor and /channel rows are informative
            if r.tensor != tensor or not r.codec.startswith("quant:") or "/" in r.codec:
                continue
            bits = int(r.codec.split(":")[1].split("/")[0])
            out.append(
                (
                    f"{tensor}: {r.codec} <= {bits + 0.1:g} bits/elem",
                    f"{r.bits_per_element:.3f}",
                    r.bits_per_element <= bits + 0.1,
                )
            )
            if ref is not None:
                ratio = _round_trip_seconds(ref) / _round_trip_seconds(r)
                out.append((f"{tensor}: {r.codec} enc+dec speed >= hivemind:float16", f"{ratio:.2f}x", ratio >= 1.0))
        if (r := by.get(("topk:0.1", tensor))) is not None and topk_ref is not None:
            ratio = _round_trip_seconds(r) / (1 / topk_ref.encode_mbps)
            out.append((f"{tensor}: topk:0.1 enc+dec time <= 1.5x torch.topk", f"{ratio:.2f}x", ratio <= 1.5))
        svd = by.get((f"torch:linalg.svd:{LOW_RANK_REFERENCE}", tensor))
        if (r := by.get((f"lowrank:{LOW_RANK_REFERENCE}/fp32", tensor))) is not None and svd is not None:
            ratio = r.rel_error / svd.rel_error if svd.rel_error else 1.0
            what = f"{tensor}: {r.codec} error <= 1.1x torch.linalg.svd's at rank {LOW_RANK_REFERENCE}"
            out.append((what, f"{ratio:.3f}x", ratio <= 1.1))
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
    amortized = [r for r in rows if r.extra and "amortized_bits_per_element" in r.extra]
    if amortized:
        lines.append("")
        lines.append("subspace bits per element over the K messages of one basis (K-1 held, one refresh):")
        for r in amortized:
            lines.append(
                f"  {r.tensor:34s} {r.codec.removesuffix(REFRESH):16s} K={r.extra['every']:<3d} {r.extra['amortized_bits_per_element']:.3f}"
            )
    stores = [r for r in rows if r.extra and "bytes_per_sample" in r.extra]
    if stores:
        lines.append("")
        lines.append(
            f"AQ-SGD buffers for {CIFAR_TRAIN_SAMPLES:,} CIFAR-10 samples at the layer1 boundary (per side, per boundary):"
        )
        for r in stores:
            e = r.extra
            lines.append(
                f"  {r.codec:20s} {e['bytes_per_sample']:>8,d} B/sample  {100 * e['fraction_of_fp32']:6.2f}% of fp32  {e['gb_for_50k_samples']:6.2f} GB"
            )
    return "\n".join(lines)


def format_targets(checks: list[tuple[str, str, bool]]) -> str:
    lines = ["targets:"]
    for what, value, ok in checks:
        lines.append(f"  [{'ok' if ok else 'MISSED'}] {what}: {value}")
    return "\n".join(lines)
