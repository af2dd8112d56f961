"""The torch.distributed baseline (swarm.bench.gloo): real gloo process groups, one process per rank."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch

from swarm.bench.gloo.__main__ import interface_of
from swarm.bench.gloo.__main__ import main as gloo_main
from swarm.bench.gloo.launch import GlooLab
from swarm.bench.gloo.stage import StageRank
from swarm.bench.gloo.trainer import own_storage
from swarm.config import load_config
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.lab.plan import LinkOptions, RunOptions
from swarm.training.experiment import build_data
from swarm.training.results import read_results

SETS = ["train.eval_every=0.5", "model.num_stages=3"]


def test_the_gloo_baseline_refuses_what_it_cannot_do(capsys):
    with pytest.raises(ValueError, match="namespaces"):
        GlooLab("configs/smoke.yaml", 2, links=LinkOptions(bandwidth="10mbit", shaping="inprocess"))
    with pytest.raises(ValueError, match="churn"):
        GlooLab("configs/smoke.yaml", 2, RunOptions(churn="kill stage1 at 5s"))
    with pytest.raises(ValueError, match="no replicas"):
        GlooLab("configs/smoke.yaml", 2, RunOptions(replicas="1=2"))
    assert gloo_main(["--rank", "3", "--world", "2", "--master", "127.0.0.1:1", "--config", "configs/smoke.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rank must be in 0..1") and err.count("\n") == 1
    assert interface_of("127.0.0.1") == "lo" and interface_of("203.0.113.9") is None  # gloo's interface by address


@pytest.mark.peers
def test_time_to_target_runs_hivepipe_and_gloo_on_the_same_shaped_links(tmp_path):
    """The whole benchmark, small: steps from one process, seconds per step from shaped lab runs
    (namespaces as root) of hivepipe and gloo, and the soonest point run to the target for real.
    Both labs' losses are one process's (gloo's ranks train its model exactly)."""
    plot = tmp_path / "ttt.png"
    command = [sys.executable, "-m", "swarm", "bench", "time-to-target", "configs/smoke.yaml", "--stages", "2"]
    command += ["--optimizers", "muon:0.1", "--schedules", "sync", "--codecs", "none,torch:gloo"]
    command += ["--bandwidth", "50mbit", "--delays", "5ms", "--target", "loss=2.1", "--lab_steps", "4"]
    command += ["--set", "train.eval_every=0.2", "--work", str(tmp_path / "work"), "--json", "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert [(r["codec"], r["kind"]) for r in rows] == [
        ("none", "estimate"),
        ("torch:gloo", "estimate"),
        ("none", "real"),
    ]
    (kept,) = (tmp_path / "work").glob("*.jsonl")  # gloo's steps are the uncompressed run's
    evals = [(r["step"], r["uncompressed"]["loss"]) for r in read_results(kept) if r["type"] == "eval"]
    first = next(step for step, loss in evals if loss <= 2.1)
    for r in rows:
        assert r["bandwidth_mbit"] == 50 and r["delay_ms"] == 5 and r["target"] == "loss<=2.1"
        assert r["steps_to_target"] == first and r["T"] == pytest.approx(first * r["step_seconds"])
        assert r["samples_per_s"] > 0 and r["step_seconds"] > 0
    assert rows[1]["oracle_gap"] == 0  # gloo's ranks: one process's floats
    assert rows[0]["oracle_gap"] < 1e-6
    assert rows[2]["measured_seconds"] > 0 and rows[2]["reached"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(line.startswith("muon:0.1 sync none at 50 Mbit/s, 5 ms: measured") for line in done.stderr.splitlines())


def test_a_micro_batch_travels_without_the_rest_of_its_batch():
    """A micro-batch split off a batch is a view of the batch's storage: pickled as it is, every
    message would carry the whole batch (found as 824 KB per sample over the trainer's link)."""
    inputs, targets = torch.randn(512, 3, 32, 32), torch.arange(512)
    ids, pieces, labels = torch.arange(512).tensor_split(64), inputs.tensor_split(64), targets.tensor_split(64)
    batch = MicroBatch(0, 1, ids[1], labels[1])
    whole = len(pickle.dumps(("forward", batch, pieces[1])))
    sent = len(pickle.dumps(("forward", *own_storage(batch, pieces[1]))))
    assert whole > 6 * 2**20 and sent < 8 * 3 * 32 * 32 * 4 + 4096
    sent_batch, sent_inputs = pickle.loads(pickle.dumps(own_storage(batch, pieces[1])))
    assert (
        torch.equal(sent_inputs, pieces[1])
        and torch.equal(sent_batch.targets, labels[1])
        and sent_batch.key == batch.key
    )


class _Outbox:
    """The messages a stage rank hands its mailbox (the network side is the benchmark's test above)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, tuple]] = []

    def send(self, rank: int, message: tuple) -> None:
        self.sent.append((rank, message))


def test_a_stage_rank_counts_training_compute_only():
    """As a swarm's stage peer does: an evaluation's forward would lower the compute bound."""
    cfg = load_config("configs/smoke.yaml", ["model.num_stages=2"])
    train = build_data(cfg)[0]
    samples = [train[i] for i in range(8)]
    ids = torch.tensor([s[0] for s in samples])
    inputs, targets = torch.stack([s[1] for s in samples]), torch.tensor([s[2] for s in samples])
    outbox = _Outbox()
    rank = StageRank(cfg, 0, outbox, total_steps=2)
    rank._compute("forward", MicroBatch(0, 0, ids, targets, mode=Mode.EVAL, exact=True), inputs)
    assert rank.compute_s == rank.compute_cpu_s == 0 and rank.samples == 0
    rank._compute("forward", MicroBatch(0, 0, ids, targets), inputs)
    assert rank.compute_s > 0 and rank.compute_cpu_s > 0 and rank.samples == 8
    assert [(to, message[0]) for to, message in outbox.sent] == [(2, "forward"), (2, "forward")]
