"""`python -m swarm bench throughput CONFIG --bandwidth RATES --codecs SPECS`: samples per second
of a shaped swarm against the bounds the links and the compute allow.

Every (codec, bandwidth) is a point: a real swarm (`swarm.lab.launch.Lab`: bootstrap, stage peers
and trainer as processes, links shaped in namespaces or in process) runs a few steps, and
swarm.bench.throughput_figures turns its results into a row: what it achieved and what bounded it.
swarm.bench.throughput_table prints, plots and sums up the rows.
"""

from __future__ import annotations

import functools
import math
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from swarm.bench.gloo.launch import GLOO, GlooLab
from swarm.bench.points import Point
from swarm.bench.throughput_figures import WARMUP_STEPS, RunLinks, ThroughputRow, measure_run
from swarm.bench.throughput_table import cpu_breakdown
from swarm.compression import parse
from swarm.config import load_config
from swarm.data import collate
from swarm.engine.microbatch import MicroBatch
from swarm.lab.launch import Lab
from swarm.lab.plan import LinkOptions, RunOptions, available_cores
from swarm.models.registry import MODELS, build_model
from swarm.rates import parse_delay, parse_rate
from swarm.training.experiment import build_data
from swarm.training.results import read_results
from swarm.transport.hivemind.net.meta import micro_batch_payload

MAX_STEPS = 64  # what --seconds may raise a point's steps to


def codec_overrides(codec: str) -> tuple[str, str, list[str]]:
    """(forward, backward, config overrides) of a --codecs entry: a spec, `FW|BW`, `adaptive:LADDER`
    (compression.adaptive with that ladder, starting uncompressed; the row's backward says so), or
    `torch:gloo` (the torch.distributed baseline, swarm.bench.gloo)."""
    if codec == GLOO:  # torch.distributed: the same stages, uncompressed
        return GLOO, "none", ["compression.forward=none", "compression.backward=none"]
    if codec.startswith("adaptive:"):
        ladder = codec.split(":", 1)[1]
        if ladder not in ("topk", "quant"):
            raise ValueError(f"bad codec {codec!r}: adaptive:topk or adaptive:quant")
        return (
            codec,
            "adaptive",
            ["compression.forward=none", "compression.backward=none", f"compression.adaptive.ladder={ladder}"],
        )
    forward, backward = codec.split("|", 1)[0], backward_spec(codec)
    return forward, backward, [f"compression.forward={forward}", f"compression.backward={backward}"]


def check_codecs(codecs: list[str]) -> None:
    """ValueError (one line) for a --codecs entry that is not a spec, `FW|BW`, adaptive:* or torch:gloo."""
    for codec in codecs:
        if codec.startswith("adaptive:") or codec == GLOO:
            codec_overrides(codec)
        else:
            for spec in codec.split("|"):
                parse(spec)


def run_point(
    codec: str, config: str, stages: int, results: Path, steps: int | None, sets: list[str], log, **shaping
) -> Lab:
    """Runs one point in the lab, hivepipe's swarm or for torch:gloo the same stages over
    torch.distributed; the lab it ran (RuntimeError if the run failed). A whole step can take
    minutes on a slow link, every micro-batch of it in flight."""
    run = RunOptions(str(results), steps, sets, trainer_args=["--timeout", "900"])
    lab = (GlooLab if codec == GLOO else Lab)(config, stages, run, LinkOptions(probe=False, **shaping), LabLines(log))
    if (code := lab.run()) != 0:
        raise RuntimeError(f"the run of {codec} at {shaping.get('bandwidth')} failed (exit code {code})")
    return lab


def backward_spec(forward: str) -> str:
    """`fw|bw` as given, else TopK gradients reuse the forward indices and others mirror the forward."""
    if "|" in forward:
        return forward.split("|", 1)[1]
    return "topk:reuse" if forward.startswith("topk:") and "+" not in forward else forward


@functools.lru_cache(maxsize=4)
def _train_set(config: str, overrides: tuple[str, ...]):
    """`config`'s training set: the data is built once per benchmark."""
    return build_data(load_config(config, list(overrides)))[0]


def _first_sample(config: str, overrides: tuple[str, ...]):
    """(config, the first training input) of `config`."""
    return load_config(config, list(overrides)), _train_set(config, overrides)[0][1]


def input_bytes_per_sample(config: str, overrides: list[str]) -> float:
    """What the trainer sends stage 0 per sample: a training micro-batch's payload (its input,
    targets and sample ids, as they travel: swarm.transport.hivemind.net.meta) over its samples."""
    cfg = load_config(config, list(overrides))
    train_set = _train_set(config, tuple(overrides))
    size = min(math.ceil(cfg.train.batch_size / cfg.train.micro_batches), len(train_set))
    ids, x, y = collate([train_set[i] for i in range(size)])
    return len(micro_batch_payload(MicroBatch(0, 0, ids, y), inputs=x)) / size


def describe_setup(config: str, overrides: list[str], cores: int) -> str:
    """The stage models the benchmark runs: what each boundary carries (one sample through the
    stages) and that their compute is small for this machine, measured per point."""
    cfg, x = _first_sample(config, tuple(overrides))
    model = build_model(cfg.model.name, cfg.model.num_stages, **cfg.model.options)
    shapes, out = [], x.unsqueeze(0)
    with torch.no_grad():
        for stage in model.stages[:-1]:
            out = stage(out)
            shapes.append(
                f"{list(out.shape[1:])} ({out[0].numel() * out.element_size() / 1024:,.0f} KiB in {str(out.dtype).removeprefix('torch.')})"
            )
    options = ", ".join(f"{k}: {v}" for k, v in cfg.model.options.items())
    builder = MODELS.get(cfg.model.name)
    about = " ".join((sys.modules[builder.__module__].__doc__ or "").split("\n\n")[0].split()) if builder else ""
    return (
        f"stage models: {cfg.model.name} ({options or 'defaults'}), {cfg.model.num_stages} stages; per sample, boundaries carry "
        + "; ".join(f"{i}: {shape}" for i, shape in enumerate(shapes))
        + (f". {about}" if about else ".")
        + f" The stages' compute on this machine's {cores} cores is measured at every point (the compute bound)."
    )


def steps_for(seconds: float, batch_size: int, samples_per_s: float | None, minimum: int, cap: int = MAX_STEPS) -> int:
    """Steps that measure about `seconds` at `samples_per_s` after the warm-up (at least `minimum`,
    at most `cap`; `minimum` when there is no estimate)."""
    if seconds <= 0 or not samples_per_s or not math.isfinite(samples_per_s):
        return minimum
    return max(minimum, min(cap, WARMUP_STEPS + math.ceil(seconds * samples_per_s / batch_size)))


def expected_samples_per_s(earlier: list[ThroughputRow], bandwidth_mbit: float) -> float | None:
    """A codec's samples/s at a new bandwidth from its nearest slower point: scaled with the rate,
    at most that point's compute bound (an overestimate, so the run is rather longer than short)."""
    slower = [r for r in earlier if r.point.bandwidth_mbit <= bandwidth_mbit]
    if not slower:
        return None
    nearest = max(slower, key=lambda r: r.point.bandwidth_mbit)
    scaled = nearest.achieved.samples_per_s * bandwidth_mbit / nearest.point.bandwidth_mbit
    return min(scaled, nearest.achieved.compute_bound)


@dataclass(frozen=True)
class ThroughputPlan:
    """What `bench throughput` runs: every (codec, bandwidth) of `config` (with `overrides`) over
    `stages` stages, `steps` steps each; `seconds` > 0: a codec's faster bandwidths run more steps
    (see `steps_for`), so that a point whose steps take a second or two is not measured over a few
    noisy seconds. Every link has the one-way `delay`, is shaped the lab's `shaping` way (None: its
    choice), and its peers pace their sends unless `pacing` is off."""

    config: str
    bandwidths: list[str]
    codecs: list[str]
    stages: int = 4
    steps: int = 4
    overrides: list[str] = field(default_factory=list)
    seconds: float = 0.0
    delay: str | None = None
    shaping: str | None = None
    pacing: bool = True


def run_throughput(plan: ThroughputPlan, log=print) -> list[ThroughputRow]:
    """The rows of `plan`'s points, bandwidths slowest first."""
    config, stages, steps, seconds, delay = plan.config, plan.stages, plan.steps, plan.seconds, plan.delay
    overrides = list(plan.overrides)
    setup = [*overrides, f"model.num_stages={stages}"]
    input_bytes = input_bytes_per_sample(config, setup)
    log(describe_setup(config, setup, available_cores()))
    bandwidths = sorted(plan.bandwidths, key=parse_rate)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hivepipe-throughput-") as tmp:
        for codec in plan.codecs:
            forward, backward, codec_sets = codec_overrides(codec)
            sets = [*overrides, *codec_sets]
            batch_size = load_config(config, sets).train.batch_size
            mine: list[ThroughputRow] = []  # this codec's points so far, for the steps of the next
            for bandwidth in bandwidths:
                results = Path(tmp) / f"{len(rows)}.jsonl"
                run_steps = steps_for(
                    seconds, batch_size, expected_samples_per_s(mine, parse_rate(bandwidth) / 1e6), steps
                )
                at = f"{bandwidth}, delay {delay}" if delay else bandwidth
                log(f"== {forward} / {backward} at {at}: {stages} stages, {run_steps} steps")
                lab = run_point(
                    codec,
                    config,
                    stages,
                    results,
                    run_steps,
                    sets,
                    log,
                    bandwidth=bandwidth,
                    delay=delay,
                    shaping=plan.shaping,
                    pacing=plan.pacing,
                )
                delay_s = parse_delay(delay) if delay else 0.0
                links = RunLinks(parse_rate(bandwidth), delay_s, download_limited=lab.link_plan.shaping == "netns")
                figures = measure_run(read_results(results), stages, links, input_bytes, cores=available_cores())
                point = Point(forward, backward, parse_rate(bandwidth) / 1e6, lab.link_plan.shaping, 1000 * delay_s)
                row = ThroughputRow.from_json({**asdict(point), **figures})
                got, cpu = row.achieved, row.cpu
                log(
                    f"   {got.samples_per_s:.1f} samples/s; link bound {got.link_bound:.1f}, compute bound {got.compute_bound:.1f}: {100 * got.fraction_of_bound:.0f}% of the bound ({got.binding}); this schedule on ideal links of this delay: {row.bounds.schedule_bound:.1f} ({100 * (row.bounds.schedule_fraction or 0):.0f}% of it)"
                    + (f"; cores {100 * cpu.machine_busy:.0f}% busy" if cpu.machine_busy is not None else "")
                )
                if cpu.cpu_ms_per_sample and cpu.compute_cpu_ms_per_sample:
                    log("   " + cpu_breakdown(row))
                if row.chosen:
                    log("   adaptive chose " + ", ".join(f"boundary {b}: {c}" for b, c in row.chosen.items()))
                rows.append(row)
                mine.append(row)
    return rows


class LabLines:
    """Keeps a lab's netlab lines and errors, drops the peers' chatter."""

    def __init__(self, log) -> None:
        self.log = log

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith(("[netlab]", "[lab]")) or "error" in line.lower() or "Traceback" in line:
                self.log("   " + line)

    def flush(self) -> None:
        pass
