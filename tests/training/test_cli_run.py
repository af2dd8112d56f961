"""`python -m swarm run` and `python -m swarm report` as a user runs them."""

from __future__ import annotations

import asyncio
import importlib
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from _util import REPO, SMOKE, cli_here, refusal

from peers._common import apply_threads
from peers.trainer import main as trainer_main
from swarm.config.messages import library_message
from swarm.engine.diverged import Diverged, require_finite
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.training.experiment import describe
from swarm.training.results import read_results


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.peers
def test_run_writes_the_documented_results(tmp_path):
    out = tmp_path / "smoke.jsonl"
    result = cli("run", str(SMOKE), "--steps", "3", "--results", str(out), "--set", "train.eval_every=0.2")
    assert result.returncode == 0, result.stderr
    rows = read_results(out)
    kinds = [r["type"] for r in rows]
    assert kinds[0] == "config" and kinds[-1] == "summary"
    steps = [r for r in rows if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) and r["bytes"] for r in steps)
    evals = [r for r in rows if r["type"] == "eval"]
    assert evals and {"compressed", "uncompressed"} <= evals[-1].keys()
    summary = rows[-1]
    assert summary["steps"] == 3 and summary["samples"] == 3 * 40
    assert set(summary["bytes"]) == {f"boundary{b}.{d}" for b in range(3) for d in ("forward", "backward")}
    assert summary["wall_time_s"] > 0


def test_report_writes_tables_and_curves(tmp_path, capsys):
    """In this process (the command line as a process: test_run_writes_the_documented_results)."""
    runs = []
    for spec in ("none", "topk:0.2"):
        out = tmp_path / f"{spec.replace(':', '')}.jsonl"
        result = cli_here(
            capsys,
            "run",
            str(SMOKE),
            "--steps",
            "2",
            "--results",
            str(out),
            "--set",
            f"compression.forward={spec}",
            "--set",
            "compression.backward=none",
            "--set",
            f"name=run-{spec}",
        )
        assert result.returncode == 0, result.stderr
        runs.append(str(out))
    result = cli_here(capsys, "report", *runs, "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    md = (tmp_path / "report" / "results.md").read_text()
    assert "run-none" in md and "run-topk:0.2" in md and "test acc % (on)" in md
    pngs = list((tmp_path / "report").glob("*.png"))
    assert pngs and pngs[0].stat().st_size > 1000


@pytest.mark.peers
def test_bad_configs_fail_with_one_line(tmp_path, capsys):
    result = cli("run", str(SMOKE), "--set", "train.bogus=1")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: train.bogus: Extra inputs are not permitted"
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    result = cli_here(capsys, "run", str(broken))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "not valid YAML: expected ',' or ']', but got '<stream end>' (line 2, column 1)" in result.stderr
    result = cli_here(capsys, "run", str(SMOKE), "--set", "compression.forward=topk:7")
    assert (
        result.returncode == 2
        and "compression.forward" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    )
    result = cli_here(capsys, "run", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = cli_here(capsys, "report", str(broken))
    assert result.returncode == 2 and result.stderr.startswith("error:")


def test_bad_options_and_paths_fail_with_one_line(tmp_path, capsys):
    result = cli_here(capsys, "run", str(SMOKE), "--set", "model.options={bogus: 1}")
    assert (
        result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    )
    assert "bogus" in result.stderr
    result = cli_here(capsys, "run", str(SMOKE), "--set", "data.options={train_size: 10}")
    assert result.returncode == 2 and "smaller than one batch" in result.stderr


def peer_refusal(capsys, module: str, *argv: str) -> str:
    """The one line peers.stage's or peers.bootstrap's serve() (in a thread of this process: no
    signal handlers of its own) refuses `argv` with; no subprocess to import torch and hivemind."""
    serve, build_parser = importlib.import_module(module).serve, importlib.import_module(module).build_parser
    capsys.readouterr()
    done: dict[str, int] = {}
    args = build_parser().parse_args(list(argv))
    thread = threading.Thread(target=lambda: done.update(code=asyncio.run(serve(args))), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{module} did not refuse {argv}: it is serving"  # a daemon: it ends with the tests
    code = done["code"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def test_peers_take_a_thread_count_and_refuse_a_bad_one(capsys):
    refused = "error: --threads must be a positive integer, got 0"
    assert peer_refusal(capsys, "peers.stage", "--stage", "0", "--config", str(SMOKE), "--threads", "0") == refused
    handler = signal.getsignal(signal.SIGTERM)  # the trainer's main() takes SIGTERM over
    try:
        assert trainer_main(["--config", str(SMOKE), "--threads", "0"]) == 2
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert capsys.readouterr().err.strip().splitlines()[-1] == refused
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not the suite's one thread (tests/conftest.py): a change that shows
        assert apply_threads(1) is None and torch.get_num_threads() == 1
        assert apply_threads(None) is None and torch.get_num_threads() == 1  # not given: left as it is
    finally:
        torch.set_num_threads(before)


def test_run_takes_the_thread_count_its_swarm_peers_take(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not the suite's one thread (tests/conftest.py): a change that shows
        done = cli_here(
            capsys, "run", str(SMOKE), "--steps", "1", "--threads", "1", "--results", str(tmp_path / "r.jsonl")
        )
        assert done.returncode == 0 and torch.get_num_threads() == 1, done.stderr
        refused = cli_here(capsys, "run", str(SMOKE), "--threads", "0")
        assert refused.returncode == 2 and "--threads: expected a positive integer, got '0'" in refused.stderr
    finally:
        torch.set_num_threads(before)


def test_run_says_when_more_steps_are_asked_than_the_config_has(capsys):
    done = cli_here(capsys, "run", str(SMOKE), "--steps", "30")  # smoke: 10 steps in all
    assert done.returncode == 0, done.stderr
    notice = "--steps 30: the config's run has 10 steps (train.epochs, train.max_steps); it stops there"
    assert notice in done.stderr.splitlines() and done.stdout.startswith("10 steps in ")


def test_peers_refuse_a_bad_daemon_thread_count_in_one_line(capsys):
    refused = "error: --daemon_threads must be 0 (one per core) or a positive integer, got -2"
    assert peer_refusal(capsys, "peers.bootstrap", "--daemon_threads", "-2") == refused
    stage = ["--stage", "0", "--config", str(SMOKE), "--daemon_threads", "-2"]
    assert peer_refusal(capsys, "peers.stage", *stage) == refused


def test_a_diverged_run_and_classes_beyond_the_models_outputs_are_one_line(capsys):
    diverged = refusal(capsys, "run", str(SMOKE), "--steps", "3", "--set", "optimizer.lr=1e9")
    assert re.fullmatch(
        r"error: stage \d: the (activations are|loss is|input gradients are) not finite in micro-batch \d of step [23]"
        r" \(NaN or inf\): the training diverged; .*",
        diverged,
    ), diverged
    classes = refusal(capsys, "run", str(SMOKE), "--set", "model.options.num_classes=3")
    assert classes == (
        "error: data: digits has 10 classes but the model digits_cnn has 3 outputs (set model.options.num_classes: 10)"
    )


def test_a_run_without_test_data_says_so_and_a_librarys_message_keeps_what_to_do():
    summary = {"steps": 2, "wall_time_s": 0.5, "final": {"uncompressed": {}, "compressed": {}}}
    assert describe(summary) == ["2 steps in 0.5s; no metrics from the evaluations (is the test split empty?)"]
    error = OSError("Couldn't instantiate the tokenizer from one of:\n  (1) a file\n\nYou need sentencepiece.")
    assert (
        library_message(error) == "Couldn't instantiate the tokenizer from one of: (1) a file You need sentencepiece."
    )
    assert len(library_message(ValueError("x" * 5000))) == 400 and library_message(KeyError()) == "KeyError"


def test_an_evaluation_that_diverges_is_named_after_the_steps_done():
    batch = MicroBatch(50, 3, torch.arange(2), torch.zeros(2, dtype=torch.long), mode=Mode.EVAL)
    require_finite(torch.ones(2), 1, "activations are", batch)  # finite: nothing to say
    with pytest.raises(
        Diverged, match=r"^stage 1: the activations are not finite in evaluation micro-batch 3 after step 50"
    ):
        require_finite(torch.tensor([1.0, float("inf")]), 1, "activations are", batch)
