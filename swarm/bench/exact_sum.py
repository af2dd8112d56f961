"""`python -m swarm bench exact-sum`: what summing a step's gradients exactly costs (swarm.engine.exactsum).

One step of a config runs in one process; each stage's micro-batches' gradients are then summed
three ways: in float64 (the reference), in float32 one after another (the sum replicas used before,
whose order depended on the split), and exactly. Printed per stage: each sum's largest error
relative to the reference's largest value, the CPU time of both sums, and, for a group of
`replicas`, what the replicas' all-reduce sends per member (both send float64 tensors; the exact
sum, on the grid the trainer sends with the group, adds its check: two values per parameter
tensor in the same all-reduce, no round of its own), its time at each bandwidth estimated from
bytes / bandwidth (not a shaped run) next to the step's busiest pipeline link at that bandwidth,
the bytes the exponent reports add (per micro-batch, stage and parameter tensor, in the result's
head), and the extra memory a replica holds while it sums.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from swarm.config import ExperimentConfig
from swarm.data import collate
from swarm.engine.exactsum import CHECK_VALUES, exact_sum
from swarm.engine.microbatch import Mode
from swarm.training.experiment import build_data
from swarm.training.loop import split_micro_batches
from swarm.transport.local import build_local_pipeline

FLOAT64 = 8  # bytes a value or presence flag takes on the replicas' all-reduce
CODE = 2  # bytes of one parameter tensor's exponent in a micro-batch's report (exactsum.pack_codes)


@dataclass
class StageCost:
    stage: int
    values: int  # gradient values of the parameters that train
    tensors: int
    exact_error: float  # largest |sum - float64 sum| / largest |float64 sum|, over the parameters
    fp32_error: float
    fp32_s: float  # CPU seconds to sum the step's micro-batches
    exact_s: float

    def allreduce_bytes(self, replicas: int, exact: bool) -> float:
        """What each member of `replicas` sends (and receives) in the butterfly all-reduce."""
        payload = FLOAT64 * (self.values + self.tensors)
        if exact:
            payload += FLOAT64 * self.tensors * CHECK_VALUES  # the grid's check, in the same all-reduce
        return 2 * (replicas - 1) / replicas * payload

    def report_bytes(self, micro_batches: int) -> int:
        """What the step's exponent reports add on the way back to the trainer, and its grid in the
        gather request to each replica (codes and counts)."""
        return CODE * self.tensors * micro_batches + 2 * CODE * self.tensors

    def extra_memory(self) -> int:
        """Bytes a replica holds beyond the float32 sum while it sums: float64 integer sums and the check."""
        return 4 * self.values + FLOAT64 * self.tensors * CHECK_VALUES * 2


@dataclass
class ExactSumReport:
    stages: list[StageCost]
    micro_batches: int
    replicas: int
    busiest_link_bytes: int  # a step's bytes on its busiest pipeline link (both directions)


def _fp32_sum(terms) -> dict[str, torch.Tensor]:
    sums: dict[str, torch.Tensor] = {}
    for term in terms:
        for name, g in term:
            sums[name] = g.clone() if name not in sums else sums[name].add_(g)
    return sums


def _error(sums: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(
        float((sums[n].double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)) for n, ref in reference.items()
    )


def _timed(fn, terms, repeats: int) -> float:
    """The median wall time of `fn(terms)`, on one thread (a peer's share on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn(terms)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def measure(cfg: ExperimentConfig, replicas: int, repeats: int = 21) -> ExactSumReport:
    pipeline, _ = build_local_pipeline(cfg, total_steps=1)
    train, _ = build_data(cfg)
    ids, inputs, targets = collate([train[i] for i in range(cfg.train.batch_size)])
    items = split_micro_batches(0, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, False)
    pipeline.run_many(items)
    stages = []
    for runtime in pipeline.runtimes:
        terms = [runtime.held[key] for key in sorted(runtime.held)]
        names = {name for term in terms for name, _ in term}
        reference = {n: sum(g.double() for term in terms for m, g in term if m == n) for n in names}
        values = sum(p.numel() for n, p in runtime.module.named_parameters() if n in names)
        stages.append(
            StageCost(
                runtime.index,
                values,
                len(names),
                _error(exact_sum(terms), reference),
                _error(_fp32_sum(terms), reference),
                _timed(_fp32_sum, terms, repeats),
                _timed(exact_sum, terms, repeats),
            )
        )
    busiest = max(
        sum(n for key, n in pipeline.link_bytes().items() if key.startswith(f"boundary{b}."))
        for b in range(cfg.model.num_stages - 1)
    )
    return ExactSumReport(stages, cfg.train.micro_batches, replicas, busiest)


def format_report(report: ExactSumReport, bandwidths_mbit: list[float], delay_ms: float) -> str:
    r = report.replicas
    lines = [
        f"one step, {report.micro_batches} micro-batches; all-reduce among {r} replicas of a stage on the "
        f"trainer's grid (times estimated from bytes / bandwidth, an all-reduce's latency {2 * delay_ms:g} ms: "
        "two one-way delays, the same for both sums)",
        "stage  values  error exact  error fp32  sum ms fp32  sum ms exact  all-reduce KiB float sum  exact  "
        "reports B  extra memory KiB",
    ]
    for s in report.stages:
        today, exact = s.allreduce_bytes(r, False), s.allreduce_bytes(r, True)
        lines.append(
            f"{s.stage:>5}  {s.values:>6}  {s.exact_error:>11.2e}  {s.fp32_error:>10.2e}  {s.fp32_s * 1e3:>11.2f}  "
            f"{s.exact_s * 1e3:>12.2f}  {today / 1024:>24.2f}  {exact / 1024:>7.2f}  "
            f"{s.report_bytes(report.micro_batches):>9}  {s.extra_memory() / 1024:>16.1f}"
        )
    for mbit in bandwidths_mbit:
        rate = mbit * 1e6 / 8
        link = report.busiest_link_bytes / rate
        for s in report.stages:
            today = s.allreduce_bytes(r, False) / rate + 2 * delay_ms / 1e3
            extra_bytes = (s.allreduce_bytes(r, True) - s.allreduce_bytes(r, False)) / rate
            reports = s.report_bytes(report.micro_batches) / rate
            cpu = max(s.exact_s - s.fp32_s, 0.0)
            added = extra_bytes + reports + cpu
            step = today + link
            lines.append(
                f"{mbit:g} Mbit/s stage {s.stage}: the float sum's all-reduce {today * 1e3:.1f} ms + busiest link "
                f"{link * 1e3:.1f} ms = {step * 1e3:.1f} ms; exact adds {added * 1e3:.2f} ms "
                f"(check bytes {extra_bytes * 1e3:.2f}, reports {reports * 1e3:.2f}, CPU {cpu * 1e3:.2f}): "
                f"{added / step:.1%}"
            )
    return "\n".join(lines)
