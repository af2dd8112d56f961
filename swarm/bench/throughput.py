"""`python -m swarm bench throughput CONFIG --bandwidth RATES --codecs SPECS`: samples per second
of a shaped swarm against the bounds the links and the compute allow.

Every (codec, bandwidth) runs a real swarm (`swarm.lab.launch.Lab`: bootstrap, stage peers and trainer
as processes, links shaped in namespaces or in process) for a few steps. From its results:
- achieved samples/s over the steady steps (the first `warmup` steps, with connection setup, are
  left out);
- payload bytes per sample of every boundary, forward and backward (what the peers sent);
- the link bound: each process has an access link of the rate in each direction, so a middle
  stage sends forward activations and backward gradients over the same up link; the busiest
  direction of the busiest process bounds samples/s. With namespaces, the bytes are those the
  kernel counted on each link over the measured steps (swarm.netlab.counters: the payload plus
  TCP/IP, TLS and libp2p framing, ACKs and DHT traffic, all of which tbf meters); in process, the
  payload (swarm.bench.bounds.pipeline_bound, also reported as `payload_link_bound`);
- the compute bound: 1 / the slowest stage's measured compute seconds per sample (compression
  included) over the measured steps, from the stage peers' own accounting; and since the lab's
  peers share this machine's cores, at most cores / the sum of the stages' compute CPU seconds
  per sample (the computing threads' CPU time, so waiting for a core is not counted as work);
- achieved / min(link bound, compute bound);
- how busy the machine's cores were over the measured steps (`machine_busy`), and where that CPU
  went per sample: the stages' computing threads (`compute_cpu_ms_per_sample`), each process and
  its p2p daemon (`cpu_ms_per_sample`; a stage process's other threads are its event loop,
  framing and pacing, and torch's workers when it runs more than one). The fraction of the cores
  bound is machine_busy x the computing threads' share of the busy CPU (`compute_share`): the
  event loops, daemons and trainer on the same cores take the rest. /proc/stat counts busy time
  by the tick and misses the daemons' short bursts at low load, so there the processes' own
  times can add up to more than the machine's.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.training.results import read_results

WARMUP_STEPS = 1
MAX_STEPS = 64  # what --seconds may raise a point's steps to


def codec_overrides(codec: str) -> tuple[str, str, list[str]]:
    """(forward, backward, config overrides) of a --codecs entry: a spec, `FW|BW`, or `adaptive:LADDER`
    (compression.adaptive with that ladder, starting uncompressed; the row's backward says so)."""
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


def backward_spec(forward: str) -> str:
    """`fw|bw` as given, else TopK gradients reuse the forward indices and others mirror the forward."""
    if "|" in forward:
        return forward.split("|", 1)[1]
    return "topk:reuse" if forward.startswith("topk:") and "+" not in forward else forward


@dataclass
class ThroughputRow:
    codec: str
    backward: str
    bandwidth_mbit: float
    samples_per_s: float
    link_bound: float
    compute_bound: float
    fraction_of_bound: float
    schedule_bound: float  # what this schedule allows on ideal fair links (swarm.bench.fluid)
    binding: str  # what the bound is: "link <process> <direction>" or "compute"
    busiest_bytes_per_sample: float  # on the binding link: counted by the kernel when measured, else the payload
    forward_bytes: list[float]  # per boundary, per training sample
    backward_bytes: list[float]
    stage_ms_per_sample: list[float]
    steps: int
    shaping: str
    cores_bound: float | None = None  # what the shared cores allow (None: not measured); compute_bound includes it
    chosen: dict[str, str] | None = None  # adaptive:*: the codecs per boundary at the end of the run
    payload_link_bound: float | None = None  # the link bound from the payload bytes alone (no headers, ACKs, DHT)
    wire_bytes_per_sample: dict[str, list[float]] | None = None  # per process: [up, down] as its link counted them
    machine_busy: float | None = None  # fraction of the machine's CPU time busy over the measured steps
    machine_cpu_ms_per_sample: float | None = None  # the machine's busy CPU time per sample over the measured steps
    compute_cpu_ms_per_sample: float | None = None  # the stages' computing threads' CPU time per sample, summed
    compute_share: float | None = None  # compute_cpu_ms_per_sample / machine_cpu_ms_per_sample
    cpu_ms_per_sample: dict[str, list[float]] | None = (
        None  # per process: [its own, its p2p daemon's] CPU time per sample
    )


def schedule_bound(
    train: dict,
    stages: int,
    bandwidth_bits: float,
    forward: list[float],
    backward: list[float],
    stage_s: list[float] | None,
    input_bytes: float,
    download_limited: bool = True,
) -> float:
    """samples/s of one step of this schedule in the fluid model, with the measured bytes and compute."""
    from swarm.bench.fluid import StepModel, simulate
    from swarm.transport.hivemind.calls import SENDING

    size = train["batch_size"] / train["micro_batches"]
    in_flight = train.get("in_flight") or 2 * stages
    compute = (
        [s * size / 2 for s in stage_s] if stage_s and len(stage_s) == stages else [0.0] * stages
    )  # forward and backward each
    model = StepModel(
        stages,
        train["micro_batches"],
        in_flight,
        SENDING,
        [b * size for b in forward],
        [b * size for b in backward],
        compute,
        bandwidth_bits,
        input_bytes * size,
        download_limited,
    )
    return train["batch_size"] / simulate(model).step_s


def measure_run(
    rows: list[dict],
    stages: int,
    bandwidth_bits: float,
    input_bytes: float,
    topology: str = "access",
    warmup: int = WARMUP_STEPS,
    download_limited: bool = True,
    cores: float | None = None,
) -> dict:
    """The figures of one finished run's results rows (see module doc); `cores`: the stages share
    that many cores (None: each has its own hardware)."""
    from swarm.bench.bounds import pipeline_bound, shared_cores_bound

    steps = [r for r in rows if r["type"] == "step"]
    if len(steps) <= warmup:
        raise ValueError(
            f"the run has {len(steps)} steps; at least {warmup + 1} are needed (the first {warmup} warm up)"
        )
    first, last = steps[warmup - 1] if warmup else {"samples": 0, "time_s": 0.0}, steps[-1]
    samples = last["samples"] - first["samples"]
    achieved = samples / (last["time_s"] - first["time_s"])
    forward, backward = [0.0] * (stages - 1), [0.0] * (stages - 1)
    for row in steps[warmup:]:
        for key, n in row["bytes"].items():  # "boundary<i>.<direction>.train"
            boundary, direction = key.split(".")[:2]
            (forward if direction == "forward" else backward)[int(boundary.removeprefix("boundary"))] += n / samples
    per_stage = stage_compute(rows, first, last)
    stage_s = [seconds / count for seconds, _, count in per_stage.values() if count] or None
    stage_cpu = [cpu / count for _, cpu, count in per_stage.values() if count]
    bound = pipeline_bound(
        bandwidth_bits,
        forward,
        backward,
        stage_s,
        topology=topology,
        names=[f"stage{i}" for i in range(stages)],
        input_bytes=input_bytes,
    )
    link, busiest, busiest_bytes = bound.link, f"{bound.busiest} {bound.direction}", bound.wire_bytes
    meter = metered(rows, first, last, samples)
    wire = meter["wire_bytes_per_sample"]
    if wire:  # the links' own counts: the bound is what tbf lets through, headers and ACKs included
        (busiest, busiest_bytes) = max(
            ((f"{name} {d}", b) for name, pair in wire.items() for d, b in zip(("up", "down"), pair, strict=True)),
            key=lambda item: item[1],
        )
        link = bandwidth_bits / 8 / busiest_bytes if busiest_bytes else math.inf
    cores_bound = shared_cores_bound(cores, stage_cpu) if cores and any(stage_cpu) else None
    compute = min(bound.compute, cores_bound or math.inf)
    limit = min(link, compute)
    if link <= compute:
        binding = f"link {busiest}"
    else:
        binding = "compute" if compute == bound.compute else f"cores ({cores:g} shared)"
    train = next(r for r in rows if r["type"] == "config")["config"]["train"]
    compute_cpu, machine_cpu = 1000 * sum(stage_cpu) if any(stage_cpu) else None, meter["machine_cpu_ms_per_sample"]
    return {
        "samples_per_s": achieved,
        "schedule_bound": schedule_bound(
            train, stages, bandwidth_bits, forward, backward, stage_s, input_bytes, download_limited
        ),
        "link_bound": link,
        "compute_bound": compute,
        "cores_bound": cores_bound,
        "fraction_of_bound": achieved / limit if limit and math.isfinite(limit) else float("nan"),
        "binding": binding,
        "busiest_bytes_per_sample": busiest_bytes,
        "payload_link_bound": bound.link,
        **meter,
        "compute_cpu_ms_per_sample": compute_cpu,
        "compute_share": compute_cpu / machine_cpu if compute_cpu and machine_cpu else None,
        "forward_bytes": forward,
        "backward_bytes": backward,
        "stage_ms_per_sample": [1000 * s for s in stage_s or []],
        "steps": len(steps),
        "chosen": steps[-1].get("codecs"),
    }


def stage_compute(rows: list[dict], first: dict, last: dict) -> dict[int, list[float]]:
    """{stage: [compute seconds, computing threads' CPU seconds, samples]} of its peers between two
    step rows (their running totals, `SwarmPipeline.step_notes`); over the whole run (the `stages`
    row) when the step rows do not carry them (an older results file) or a peer left meanwhile."""

    def totals(peers: list[dict]) -> dict[int, list[float]]:
        per_stage: dict[int, list[float]] = {}
        for peer in peers:
            seconds, cpu, count = per_stage.get(peer["stage"], [0.0, 0.0, 0])
            per_stage[peer["stage"]] = [
                seconds + peer["compute_s"],
                cpu + peer.get("compute_cpu_s", 0.0),
                count + peer["samples"],
            ]
        return per_stage

    if "stages" in last and ("stages" in first or "step" not in first):  # no warm-up: from the start
        before, after = totals(first.get("stages", [])), totals(last["stages"])
        between = {
            stage: [a - b for a, b in zip(now, before.get(stage, [0.0, 0.0, 0]), strict=True)]
            for stage, now in after.items()
        }
        if set(before) <= set(after) and all(
            count > 0 and seconds >= 0 and cpu >= 0 for seconds, cpu, count in between.values()
        ):
            return between
    return totals(next((r for r in rows if r["type"] == "stages"), {"stages": []})["stages"])


def metered(rows: list[dict], first: dict, last: dict, samples: int) -> dict:
    """Per sample between two step rows, from a lab's meter row (all None without one: an older
    results file, or a run outside the lab): `wire_bytes_per_sample` {process: [bytes up, bytes
    down]} (None without namespaces), `machine_busy` (fraction), `machine_cpu_ms_per_sample`,
    `cpu_ms_per_sample` {process: [its own, its p2p daemon's] CPU ms} (None if not sampled)."""
    from swarm.netlab.counters import window

    meter = next((r for r in rows if r["type"] == "meter"), None)
    if meter is None or "at" not in first or "at" not in last:
        return dict.fromkeys(
            ("wire_bytes_per_sample", "machine_busy", "machine_cpu_ms_per_sample", "cpu_ms_per_sample")
        )
    counted = window(meter, first["at"], last["at"])
    return {
        "wire_bytes_per_sample": {
            name: [counted.sent[name] / samples, counted.received[name] / samples] for name in counted.sent
        }
        or None,
        "machine_busy": counted.busy,
        "machine_cpu_ms_per_sample": 1000 * counted.busy_s / samples,
        "cpu_ms_per_sample": {name: [1000 * s / samples for s in pair] for name, pair in counted.cpu.items()} or None,
    }


@functools.lru_cache(maxsize=4)
def _first_sample(config: str, overrides: tuple[str, ...]):
    """(config, the first training input) of `config`: the data is built once per benchmark."""
    from swarm.config import load_config
    from swarm.training.loop import build_data

    cfg = load_config(config, list(overrides))
    return cfg, build_data(cfg)[0][0][1]


def input_bytes_per_sample(config: str, overrides: list[str]) -> float:
    """What the trainer sends stage 0 per sample (its raw input tensor)."""
    _, x = _first_sample(config, tuple(overrides))
    return float(x.numel() * x.element_size())


def describe_setup(config: str, overrides: list[str], cores: int) -> str:
    """The stage models the benchmark runs: what each boundary carries (one sample through the
    stages) and that their compute is small for this machine, measured per point."""
    import torch

    from swarm.models.registry import MODELS, build_model

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
    slower = [r for r in earlier if r.bandwidth_mbit <= bandwidth_mbit]
    if not slower:
        return None
    nearest = max(slower, key=lambda r: r.bandwidth_mbit)
    return min(nearest.samples_per_s * bandwidth_mbit / nearest.bandwidth_mbit, nearest.compute_bound)


def run_throughput(
    config: str,
    bandwidths: list[str],
    codecs: list[str],
    stages: int = 4,
    steps: int = 4,
    shaping: str | None = None,
    overrides: list[str] | None = None,
    log=print,
    pacing: bool = True,
    seconds: float = 0.0,
) -> list[ThroughputRow]:
    """`seconds` > 0: a codec's faster bandwidths run more steps (see `steps_for`), so that a point
    whose steps take a second or two is not measured over a few noisy seconds; bandwidths run slowest first."""
    from swarm.config import load_config
    from swarm.lab.launch import Lab, available_cores
    from swarm.netlab.rates import parse_rate

    overrides = list(overrides or [])
    setup = [*overrides, f"model.num_stages={stages}"]
    input_bytes = input_bytes_per_sample(config, setup)
    log(describe_setup(config, setup, available_cores()))
    bandwidths = sorted(bandwidths, key=parse_rate)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hivepipe-throughput-") as tmp:
        for codec in codecs:
            forward, backward, codec_sets = codec_overrides(codec)
            sets = [*overrides, *codec_sets]
            batch_size = load_config(config, sets).train.batch_size
            mine: list[ThroughputRow] = []  # this codec's points so far, for the steps of the next
            for bandwidth in bandwidths:
                results = Path(tmp) / f"{len(rows)}.jsonl"
                run_steps = steps_for(
                    seconds, batch_size, expected_samples_per_s(mine, parse_rate(bandwidth) / 1e6), steps
                )
                log(f"== {forward} / {backward} at {bandwidth}: {stages} stages, {run_steps} steps")
                # a whole step can take minutes on a slow link, and every micro-batch of it is in flight
                lab = Lab(
                    config,
                    stages,
                    str(results),
                    run_steps,
                    sets,
                    bandwidth=bandwidth,
                    shaping=shaping,
                    probe=False,
                    pacing=pacing,
                    out=_Quiet(log),
                    trainer_args=["--timeout", "900"],
                )
                code = lab.run()
                if code != 0:
                    raise RuntimeError(f"the swarm for {codec} at {bandwidth} failed (exit code {code})")
                figures = measure_run(
                    read_results(results),
                    stages,
                    parse_rate(bandwidth),
                    input_bytes,
                    download_limited=lab.shaping == "netns",
                    cores=available_cores(),
                )
                row = ThroughputRow(forward, backward, parse_rate(bandwidth) / 1e6, shaping=lab.shaping, **figures)
                log(
                    f"   {row.samples_per_s:.1f} samples/s; link bound {row.link_bound:.1f}, compute bound {row.compute_bound:.1f}: {100 * row.fraction_of_bound:.0f}% of the bound ({row.binding}); this schedule on ideal links: {row.schedule_bound:.1f}"
                    + (f"; cores {100 * row.machine_busy:.0f}% busy" if row.machine_busy is not None else "")
                )
                if row.cpu_ms_per_sample and row.compute_cpu_ms_per_sample:
                    log("   " + cpu_breakdown(row))
                if row.chosen:
                    log("   adaptive chose " + ", ".join(f"boundary {b}: {c}" for b, c in row.chosen.items()))
                rows.append(row)
                mine.append(row)
    return rows


def cpu_breakdown(row: ThroughputRow) -> str:
    """Where the machine's CPU went per sample: the stages' computing threads, the rest of the stage
    peers (event loops, framing, pacing), their p2p daemons, the trainer and bootstrap, the rest."""
    cpu = row.cpu_ms_per_sample or {}
    stages = [pair for name, pair in cpu.items() if name.startswith("stage")]
    others = [pair for name, pair in cpu.items() if not name.startswith("stage")]
    compute = row.compute_cpu_ms_per_sample or 0.0
    parts = {
        "stage compute": compute,
        "stage peers' other threads": sum(own for own, _ in stages) - compute,
        "stage p2p daemons": sum(daemon for _, daemon in stages),
        "trainer and bootstrap (and daemons)": sum(own + daemon for own, daemon in others),
    }
    rest = (row.machine_cpu_ms_per_sample or 0.0) - sum(parts.values())
    return (
        f"CPU per sample: {row.machine_cpu_ms_per_sample or 0.0:.2f} ms = "
        + " + ".join(f"{name} {ms:.2f}" for name, ms in parts.items())
        + f" + the rest of the machine {rest:.2f}; compute is {100 * (row.compute_share or 0):.0f}% of it"
    )


class _Quiet:
    """Keeps a lab's netlab lines and errors, drops the peers' chatter."""

    def __init__(self, log) -> None:
        self.log = log

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith(("[netlab]", "[lab]")) or "error" in line.lower() or "Traceback" in line:
                self.log("   " + line)

    def flush(self) -> None:
        pass


def format_rows(rows: list[ThroughputRow]) -> str:
    header = [
        "codec (fw / bw)",
        "Mbit/s",
        "samples/s",
        "link bound",
        "compute bound",
        "of bound",
        "schedule bound",
        "busiest B/sample",
        "binding",
    ]
    table = [header] + [
        [
            f"{r.codec} / {r.backward}",
            f"{r.bandwidth_mbit:g}",
            f"{r.samples_per_s:.1f}",
            f"{r.link_bound:.1f}",
            f"{r.compute_bound:.1f}",
            f"{100 * r.fraction_of_bound:.0f}%",
            f"{r.schedule_bound:.1f}",
            f"{r.busiest_bytes_per_sample:,.0f}",
            r.binding,
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
        for line in table
    )


def speedups(rows: list[ThroughputRow], baseline: str = "none") -> dict[tuple[str, float], float]:
    """samples/s of each codec over the baseline's at the same bandwidth."""
    base = {r.bandwidth_mbit: r.samples_per_s for r in rows if r.codec == baseline}
    return {
        (r.codec, r.bandwidth_mbit): r.samples_per_s / base[r.bandwidth_mbit]
        for r in rows
        if r.bandwidth_mbit in base and r.codec != baseline
    }


TARGET_FRACTION = 0.8  # the target: achieved >= 80% of min(link bound, compute bound)


def target_lines(rows: list[ThroughputRow], target: float = TARGET_FRACTION) -> list[str]:
    """How the rows stand against `target`, the link-bound points (the comm-bound configurations)
    apart from those the compute or the shared cores bound (where the p2p daemons, event loops and
    trainer take CPU from the stages: compute_share says how much)."""

    def name(r: ThroughputRow) -> str:
        return f"{r.codec} at {r.bandwidth_mbit:g} Mbit/s {100 * r.fraction_of_bound:.0f}%"

    measured = [r for r in rows if math.isfinite(r.fraction_of_bound)]
    linked = [r for r in measured if r.binding.startswith("link")]
    lines = []
    if linked:
        low = min(linked, key=lambda r: r.fraction_of_bound)
        met = sum(r.fraction_of_bound >= target for r in linked)
        lines.append(
            f"link-bound points at >= {100 * target:.0f}% of the bound: {met} of {len(linked)} (lowest: {name(low)})"
        )
    for r in measured:
        if not r.binding.startswith("link"):
            share = (
                f"; the stages' compute used {100 * r.compute_share:.0f}% of the busy CPU" if r.compute_share else ""
            )
            lines.append(f"bound by {r.binding}: {name(r)}{share}")
    return lines


def plot(rows: list[ThroughputRow], path: str, title: str) -> None:
    """samples/s against bandwidth per codec, with each codec's link bound (dashed) and compute bound (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, codec in enumerate(dict.fromkeys(r.codec for r in rows)):
        mine = sorted((r for r in rows if r.codec == codec), key=lambda r: r.bandwidth_mbit)
        color = f"C{i}"
        x = [r.bandwidth_mbit for r in mine]
        ax.plot(x, [r.samples_per_s for r in mine], "o-", color=color, label=f"{codec} / {mine[0].backward}")
        ax.plot(x, [r.link_bound for r in mine], "--", color=color, alpha=0.6)
        compute = [(b, r.compute_bound) for b, r in zip(x, mine, strict=True) if math.isfinite(r.compute_bound)]
        if compute:  # measured at each point: the stages share this machine's cores with the traffic
            ax.plot(*zip(*compute, strict=True), ":", color=color, alpha=0.6)
    ax.plot([], [], "k--", alpha=0.6, label="link bound")
    ax.plot([], [], "k:", alpha=0.6, label="compute bound (measured per point)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth per process link (Mbit/s)")
    ax.set_ylabel("training samples / s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(rows: list[ThroughputRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
