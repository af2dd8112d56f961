"""`python -m swarm bench exact-sum --memory`: what summing a step exactly adds to a replica's peak memory.

A replica holds its micro-batches' gradients until the step's gather; then it sums them and hands
the sum to the all-reduce in float64 (averaging.WIRE_DTYPE). Measured here in one process standing
in for a replica: the middle stage of a GPT-2-small-sized model (one block, 768 wide, 12 heads:
7.1M parameters) runs `micro_batches` micro-batches of `tokens` tokens forward and backward (its
held gradients), then the gather's computing two ways, each from the same held gradients:

- float: the float32 sum in order (as replicas summed before) and its float64 copy for the wire;
- exact: the replica's combine path (stage.replicasum): the step's codes of what it holds (its
  check of the trainer's grid), its integers on the grid (float64, already the wire's), the grid
  check, and the sum in the parameters' dtype from the integers (`from_grid`).

Memory is the process's resident set from /proc (Linux): the high-water mark reset before each
(`clear_refs`), less what was resident before it; glibc's mmap threshold is pinned low (the
probe runs in a child process with MALLOC_MMAP_THRESHOLD_) so a freed tensor leaves the resident
set at once and one measure does not hide in another's freed pages. The all-reduce's own buffers
(its float64 parts and deltas) are the same for both sums and left out.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from swarm.engine.exactsum import from_grid, grid_check, grid_of, integer_sums, step_codes, trained_names

MMAP_THRESHOLD = 1 << 16  # bytes: allocations above it get pages of their own, returned when freed
PROC = Path("/proc/self")


def _resident(field: str) -> int:
    """Bytes of /proc/self/status's `field` (VmRSS, VmHWM)."""
    for line in (PROC / "status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_added(fn) -> tuple[int, object]:
    """The resident set's high-water mark while `fn()` runs, less the resident set before it; and its result."""
    gc.collect()
    (PROC / "clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _resident("VmRSS")
    result = fn()
    return _resident("VmHWM") - before, result


def _float_sum(terms) -> dict[str, torch.Tensor]:
    sums: dict[str, torch.Tensor] = {}
    for term in terms:
        for name, g in term:
            sums[name] = g.clone() if name not in sums else sums[name].add_(g)
    return {name: g.to(torch.float64) for name, g in sums.items()}  # the all-reduce's copy


def _exact_sum(terms, names) -> dict[str, torch.Tensor]:
    """The replica's computing around the all-reduce (stage.replicasum): codes, integers, check, sum."""
    codes, counts, _ = step_codes(terms, names)
    grid, single = grid_of(codes, counts, names)
    integers = integer_sums(terms, grid, single)
    grid_check(codes, counts, codes)
    return {name: from_grid(total, grid.get(name), torch.float32) for name, total in integers.items()}


def probe(micro_batches: int, tokens: int) -> dict[str, int]:
    """In this process (Linux): bytes of the gradients held, the backward's peak, and each sum's added peak."""
    from swarm.models.gpt2 import build_gpt2

    torch.manual_seed(0)
    block = build_gpt2(3, {"n_layer": 3}).stages[1]  # GPT-2 small's block: the middle stage of three
    names = trained_names(block)
    params = [p for _, p in block.named_parameters() if p.requires_grad]
    terms = []

    def backward() -> None:
        for _ in range(micro_batches):
            x = torch.randn(1, tokens, 768)
            y = block(x)
            grads = torch.autograd.grad(y, params, torch.randn_like(y))
            terms.append(list(zip(names, grads, strict=True)))

    backward_peak, _ = _peak_added(backward)
    held = sum(g.numel() * g.element_size() for term in terms for _, g in term)
    float_peak, kept = _peak_added(lambda: _float_sum(terms))
    del kept
    exact_peak, kept = _peak_added(lambda: _exact_sum(terms, names))
    return {
        "values": sum(p.numel() for p in params),
        "held": held,
        "backward": backward_peak,
        "float": float_peak,
        "exact": exact_peak,
    }


def measure(micro_batches: int, tokens: int) -> dict[str, int]:
    """`probe` in a child process with glibc's mmap threshold pinned (see the module's doc)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    code = f"import json; from swarm.bench.exact_sum_memory import probe; print(json.dumps(probe({micro_batches}, {tokens})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"the memory probe failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_memory(found: dict[str, int], micro_batches: int, tokens: int) -> str:
    mib = 1 << 20
    return "\n".join(
        [
            f"memory of a replica: GPT-2 small's block ({found['values']:,} values), {micro_batches} micro-batches "
            f"of {tokens} tokens",
            f"gradients held: {found['held'] / mib:.1f} MiB; the backwards' peak above what was resident: "
            f"{found['backward'] / mib:.1f} MiB",
            f"the gather's peak above the held gradients: float sum {found['float'] / mib:.1f} MiB, "
            f"exact sum {found['exact'] / mib:.1f} MiB (adds {(found['exact'] - found['float']) / mib:+.1f} MiB)",
            f"the replica's peak: the backwards' {found['backward'] / mib:.1f} MiB against the gather's "
            f"{(found['held'] + found['exact']) / mib:.1f} MiB (held + exact sum): the exact sum raises it by "
            f"{max(found['held'] + found['exact'] - max(found['backward'], found['held'] + found['float']), 0) / mib:.1f} MiB",
        ]
    )
