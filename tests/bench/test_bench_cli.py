"""The codec benchmark's command line: JSON rows with the documented keys, and clear errors."""

import contextlib
import io
import json
import subprocess
import sys

import pytest
from _util import cli_here

from swarm.bench.codecs import CODECS, LOW_RANK_CODECS, REFRESH, SUBSPACE_CODECS, WARM_CODECS

REQUIRED = {"codec", "tensor", "bits_per_element", "rel_error", "encode_mbps", "decode_mbps"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """The codecs bench's rows, run in this process (a new interpreter would cost seconds of imports)."""
    from swarm.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "codecs", "--json", "--scale", "0.02", "--repeat", "1"]) in (0, None)
    return json.loads(out.getvalue())


def test_json_rows_have_the_documented_keys(rows):
    assert rows, "no rows"
    for row in rows:
        assert REQUIRED <= row.keys(), row


def test_every_codec_and_reference_is_measured_on_every_tensor(rows):
    tensors = {r["tensor"] for r in rows}
    assert len(tensors) == 5
    for tensor in tensors:
        codecs = {r["codec"] for r in rows if r["tensor"] == tensor}
        assert set(CODECS) | {"hivemind:float16", "torch:topk:0.1"} <= codecs
        low_rank = set(LOW_RANK_CODECS) | set(WARM_CODECS) | {"torch:svd_lowrank:32", "torch:linalg.svd:32"}
        low_rank |= set(SUBSPACE_CODECS) | {spec + REFRESH for spec in SUBSPACE_CODECS}
        assert low_rank <= codecs if tensor.startswith("gpt2.") else not low_rank & codecs


def test_low_rank_rows_against_torch_linalg(rows):
    """lowrank:R's bits are its two factors; its error is near the truncated SVD's at the same rank
    on the tensor with a falling spectrum, and far below TopK's at fewer bits."""
    by = {(r["codec"], r["tensor"]): r for r in rows}
    tensor = next(t for _, t in by if t.startswith("gpt2.anisotropic"))
    rows_, cols = 1024, 768  # --scale 0.02 keeps one sample of [8, 1024, 768]
    assert by[("lowrank:32", tensor)]["bits_per_element"] == pytest.approx(
        16 * 32 * (rows_ + cols) / (rows_ * cols), rel=0.01
    )
    assert by[("lowrank:32/q8", tensor)]["bits_per_element"] < 0.55 * by[("lowrank:32", tensor)]["bits_per_element"]
    best = by[("torch:linalg.svd:32", tensor)]["rel_error"]
    assert best <= by[("lowrank:32/fp32", tensor)]["rel_error"] < 1.1 * best
    assert by[("lowrank:32", tensor)]["rel_error"] < 0.5 * by[("topk:0.1/fp16", tensor)]["rel_error"]


def test_bits_per_element_come_from_payload_sizes(rows):
    by = {(r["codec"], r["tensor"]): r for r in rows}
    for (codec, tensor), row in by.items():
        if codec == "none":
            assert 32.0 <= row["bits_per_element"] < 32.5
            assert row["rel_error"] == 0.0
        if codec in ("quant:4", "quant:2"):
            bits = int(codec.split(":")[1])
            assert bits <= row["bits_per_element"] <= bits + 0.1
        if codec == "topk:reuse/fp16":
            # values only: 10% of the elements at 16 bits, no indices
            assert row["bits_per_element"] < by[("topk:0.1/fp16", tensor)]["bits_per_element"]


def test_store_rows_report_memory(rows):
    stores = [r for r in rows if r.get("kind") == "aqsgd_store"]
    assert {r["codec"] for r in stores} >= {"aqsgd-store:fp32", "aqsgd-store:q6"}
    fp32 = next(r for r in stores if r["codec"] == "aqsgd-store:fp32")
    q6 = next(r for r in stores if r["codec"] == "aqsgd-store:q6")
    assert q6["bytes_per_sample"] < 0.25 * fp32["bytes_per_sample"]


def test_bad_cli_values_get_one_line_errors(capsys):
    result = cli_here(capsys, "bench", "codecs", "--scale", "2")
    assert result.returncode == 2 and "expected a number in (0, 1]" in result.stderr
    result = cli_here(capsys, "bench", "nothing")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.peers
def test_stream_bench_times_both_modes_over_real_daemons(capsys):
    """`bench streams` runs two hivemind peers and reports per-exchange wall and CPU time for a new
    stream per exchange and for one kept stream (the figures are read, not asserted)."""
    result = run_cli("bench", "streams", "--exchanges", "20", "--payload_kb", "8", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["mode"] for r in rows] == ["new stream each", "one stream"]
    for row in rows:
        assert row["exchanges"] == 20 and row["wall_ms"] > 0 and row["cpu_ms"] > 0
    result = cli_here(capsys, "bench", "streams", "--payload_kb", "-3")
    assert (
        result.returncode == 2
        and "--payload_kb: expected a positive integer, got '-3'" in result.stderr.strip().splitlines()[-1]
    )


@pytest.mark.peers
def test_fuzz_bench_prints_outcomes_per_category_and_the_runs_losses(capsys):
    """`bench fuzz` attacks a small training swarm and says how each category of message ended and
    whether the losses are one process's (its memory figure, a growth of this process's peak, means
    little inside the suite's process and is not checked)."""
    result = cli_here(capsys, "bench", "fuzz", "--count", "150", "--steps", "2")  # its swarm in this process
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for category in ("random bytes", "bad chunks", "member's bad payload", "stalled stream", "setup call"):
        assert category in out
    assert "hung: 0" in out and "every stage peer still serving: yes" in out
    assert "largest relative loss difference to one process 0.00e+00" in out
    result = cli_here(capsys, "bench", "fuzz", "--count", "0")
    assert result.returncode == 2 and "--count: expected a positive integer" in result.stderr


def test_subspace_rows_cost_rank_over_cols_and_a_refresh_what_lowrank_does(rows):
    """A message in a held basis: 16 R / cols bits per element; the refresh carrying the basis
    costs what a lowrank:R message does; amortized over K = 32 in between, near the held cost."""
    by = {(r["codec"], r["tensor"]): r for r in rows}
    tensor = next(t for _, t in by if t.startswith("gpt2.anisotropic"))
    held, refresh = by[("subspace:32", tensor)], by[("subspace:32" + REFRESH, tensor)]
    assert held["bits_per_element"] == pytest.approx(16 * 32 / 768, rel=0.01)
    assert refresh["bits_per_element"] == pytest.approx(by[("lowrank:32", tensor)]["bits_per_element"], rel=0.01)
    amortized = refresh["amortized_bits_per_element"]
    assert held["bits_per_element"] < amortized < held["bits_per_element"] * 1.05
    # a basis from another micro-batch of a falling spectrum: within 10% of lowrank's fresh error
    assert held["rel_error"] < 1.1 * by[("lowrank:32", tensor)]["rel_error"]


def test_warm_low_rank_rows_cost_what_plain_ones_do(rows):
    """A warm sender's message is a plain low-rank payload: the same bits; started from another
    micro-batch of the falling spectrum (the same directions), its one power iteration errs no
    more than plain lowrank's two, within 1%."""
    by = {(r["codec"], r["tensor"]): r for r in rows}
    tensor = next(t for _, t in by if t.startswith("gpt2.anisotropic"))
    for spec in WARM_CODECS:
        warm, plain = by[(spec, tensor)], by[(spec.removesuffix("/warm"), tensor)]
        assert warm["bits_per_element"] == plain["bits_per_element"]
        assert warm["rel_error"] <= 1.01 * plain["rel_error"], (spec, warm["rel_error"], plain["rel_error"])


def test_exact_sum_bench_prints_precision_bytes_time_and_memory(capsys):
    from _util import SMOKE

    from swarm.bench import exact_sum
    from swarm.cli.main import main
    from swarm.config import load_config

    assert main(["bench", "exact-sum", str(SMOKE), "--replicas", "3", "--bandwidth", "10"]) == 0
    out = capsys.readouterr().out
    assert "all-reduce among 3 replicas" in out and "10 Mbit/s stage 3: the float sum's all-reduce" in out
    report = exact_sum.measure(load_config(SMOKE, []), replicas=2, repeats=1)
    assert len(report.stages) == 4 and all(s.exact_error <= s.fp32_error for s in report.stages)
    stage = report.stages[1]  # no grid round: the grid's check, two values per parameter tensor
    added = stage.allreduce_bytes(2, True) - stage.allreduce_bytes(2, False)
    assert added == 8 * stage.tensors * 2
    assert main(["bench", "exact-sum", str(SMOKE), "--replicas", "1"]) == 2


def test_exact_sum_memory_measures_a_replicas_gather_against_the_float_sum(capsys):
    """GPT-2 small's block, one short micro-batch: the exact sum's integers (float64) and its result
    cost more than the float sum and its float64 copy for the wire, and the probe says by how much."""
    from swarm.bench.exact_sum_memory import measure
    from swarm.cli.main import main

    found = measure(micro_batches=2, tokens=16)
    held = found["held"]
    assert found["values"] == 7_087_872 and held == 2 * 4 * found["values"]
    # the float sum: float32 and its float64 copy (12 bytes a value); the exact sum holds its float64
    # integers and the float32 result, with one tensor's float64 temporaries on top
    assert 0.9 * held * 12 / 8 <= found["float"] < found["exact"] < held * 12 / 8 + held
    assert main(["bench", "exact-sum", "--memory", "--tokens", "16", "--micro_batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "GPT-2 small's block" in out and "exact sum" in out and "raises it by" in out
