"""A swarm on real hivemind in this process (loopback): bootstrap, stage hosts and a trainer node,
and the oracle helpers (a run through the swarm vs. the same run in one process).

Shared by the swarm tests: one `Swarm` for the whole session (the `swarm` fixture, conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _util import SMOKE, write_tiny_tokenizer

from swarm.config import load_config
from swarm.engine.stash import WeightStash
from swarm.lab.plan import peer_threads
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter, read_results
from swarm.transport.hivemind.net.loop import LoopThread
from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline

HOSTS = 5
SETTINGS = Settings.of(call_timeout_s=30, read_timeout_s=10)  # a test's peers give up sooner than a swarm's


TAG = "HIVEPIPE_TEST_COMMAND"  # in the environment of a command's processes, their p2p daemons' too


@dataclass
class Finished:
    """A command run to its end (`run_tagged`): its result, how many of its p2p daemons outlived
    it, and its pid (the namespaces a lab makes are named after it: hp-PID-...)."""

    done: subprocess.CompletedProcess
    daemons_left: int
    pid: int


def run_tagged(command: list[str], timeout: float, cwd) -> Finished:
    """Runs `command` and counts the p2p daemons it left behind. Its daemons are told apart by a tag
    in their environment: a machine-wide count would also see the daemons of other swarms on this
    machine (the suite's other worker, other users) come and go meanwhile."""
    tag = uuid.uuid4().hex
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env={**os.environ, TAG: tag}
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    left = 0
    for pid in subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout.split():
        try:
            left += f"{TAG}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            pass
    return Finished(subprocess.CompletedProcess(command, process.returncode, out, err), left, process.pid)


class Swarm:
    """A bootstrap peer, HOSTS stage hosts (each a P2P daemon + DHT node + stage server) and a trainer."""

    def __init__(self) -> None:
        self.loop = LoopThread("test-swarm")
        self.boot = self.loop.run(SwarmNode.create())
        self.maddrs = self.loop.run(self.boot.maddrs())
        self.hosts: list[tuple[SwarmNode, StageServer]] = []
        for _ in range(HOSTS):
            node = self.loop.run(SwarmNode.create(self.options()))
            server = StageServer(node)
            self.loop.run(server.start())
            self.hosts.append((node, server))
        self.trainer = self.loop.run(SwarmNode.create(self.options(client_mode=True)))

    def options(self, **fields) -> NodeOptions:
        """A peer of this swarm: it joins through the bootstrap, with the tests' settings."""
        return NodeOptions(initial_peers=self.maddrs, **{"settings": SETTINGS, **fields})

    def host(self, cfg, run_id: str, placement: list[tuple[int, int]]) -> list[HostedStage]:
        """Hosts stage s on host h for every (s, h) and announces at once."""
        hosted = []
        for stage, index in placement:
            node, server = self.hosts[index]
            hosted.append(server.host(HostedStage(node, run_id, cfg, stage)))
        for _, index in placement:
            self.loop.run(self.hosts[index][1].announcer.announce_now())
        return hosted

    def mortal_host(self, shape_rate: str | None = None) -> tuple[SwarmNode, StageServer]:
        """A host of its own, for a test to kill or shape (not one of the shared HOSTS)."""
        node = self.loop.run(SwarmNode.create(self.options(shape_rate=shape_rate)))
        server = StageServer(node)
        self.loop.run(server.start())
        return node, server

    def unhost(self, run_id: str) -> None:
        """The shared hosts stop hosting `run_id`'s stages (the next test's run starts clean)."""
        for _, server in self.hosts:
            for key in [k for k in server.hosted if k[0] == run_id]:
                server.hosted.pop(key).close()

    def pipeline(self, cfg, run_id: str, steps: int, data, snapshot_every: int = 0) -> SwarmPipeline:
        pipeline = SwarmPipeline(self.trainer, self.loop, cfg, run_id, snapshot_every=snapshot_every)
        schedule = Schedule.of(cfg, len(data[0]), steps)
        pipeline.setup(schedule.lr_horizon, len(data[0]), wait_s=20)
        return pipeline

    def close(self) -> None:
        for node, server in self.hosts:
            self.loop.run(server.stop())
            self.loop.run(node.shutdown())
        self.loop.run(self.trainer.shutdown())
        self.loop.run(self.boot.shutdown())
        self.loop.stop()


STEPS = 5


def smoke(*overrides: str):
    return load_config(SMOKE, ["train.eval_every=0.5", *overrides])


def tiny_gpt2(tmp_path, *overrides: str):
    """A 2-layer GPT-2 over 3 stages (its embedding and LM head tied across stages 0 and 2), on a
    small text and tokenizer written under `tmp_path`, clipping at every step."""
    data = tmp_path / "wikitext"
    data.mkdir()
    text = "\n = Article = \n\n the cat sat on the mat , and the dog ran to the end of the road . \n"
    (data / "wiki.train.raw").write_text(text * 40, encoding="utf-8")
    (data / "wiki.valid.raw").write_text(text * 4, encoding="utf-8")
    (tmp_path / "tokenizer").mkdir()
    tokenizer = write_tiny_tokenizer(tmp_path / "tokenizer")
    path = tmp_path / "tied.yaml"
    path.write_text(
        f"""name: tied
seed: 0
model:
  name: gpt2
  num_stages: 3
  options:
    config: {{n_layer: 2, n_embd: 32, n_head: 2, n_positions: 16, vocab_size: 260, resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0}}
data:
  name: wikitext2
  data_dir: {data}
  options: {{tokenizer: {tokenizer}, block_size: 16}}
optimizer: {{name: adamw, lr: 0.003, weight_decay: 0.0, grad_clip: 0.05}}
train: {{epochs: 4, batch_size: 8, micro_batches: 4, eval_every: 1, eval_batch_size: 8}}
compression: {{forward: none, backward: none}}
"""
    )
    return load_config(path, list(overrides))


class AfterStep(ResultsWriter):
    """Results that call `hook()` right after step `after`'s row (between two steps of the loop)."""

    def __init__(self, after: int, hook) -> None:
        super().__init__(None)
        self.after, self.hook = after, hook

    def write(self, row) -> None:
        super().write(row)
        if row.get("type") == "step" and row["step"] == self.after:
            self.hook()


def step_losses(rows) -> list[float]:
    """A results file's per-step losses, in order."""
    return [r["loss"] for r in rows if r["type"] == "step"]


def forwards_at_kept_weights(monkeypatch) -> list[int]:
    """The steps of the forwards that will run at a stage's kept weights (swarm.engine.stash: an
    asynchronous micro-batch overtaken or sent again after its stage's next update), as they run."""
    late: list[int] = []
    running = WeightStash.running

    def recorded(stash: WeightStash, step: int):
        if stash.serves(step):
            late.append(step)
        return running(stash, step)

    monkeypatch.setattr(WeightStash, "running", recorded)
    return late


def assert_close_losses(ours: list[float], theirs: list[float]) -> None:
    """As many losses, each within 1e-5 (relative) of one process's."""
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, theirs)


def swarm_rows(env: Swarm, cfg, steps: int = STEPS, placement=None):
    run_id = uuid.uuid4().hex[:8]
    env.host(cfg, run_id, placement or [(s, s) for s in range(cfg.model.num_stages)])
    try:
        data = build_data(cfg)
        pipeline = env.pipeline(cfg, run_id, steps, data)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, steps, progress=False)
        return results.rows
    finally:
        env.unhost(run_id)


def local_rows(cfg, tmp_path, steps: int = STEPS):
    path = tmp_path / f"local-{uuid.uuid4().hex[:6]}.jsonl"
    run_experiment(cfg, path, steps, progress=False)
    return read_results(path)


def one_process_meanwhile(config, overrides: list[str], tmp_path, steps: int, stage_peers: int | None = None) -> Future:
    """The one-process run `assert_losses_of_one_process` compares a lab's with, started now on a
    thread: it computes while the lab runs (whose peers mostly wait on their delayed links), not
    after it. Pass the future to the assertion as `reference`."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-process")
    future = pool.submit(_one_process_rows, config, overrides, tmp_path, steps, stage_peers)
    pool.shutdown(wait=False)
    return future


def _one_process_rows(config, overrides: list[str], tmp_path, steps: int, stage_peers: int | None) -> list[dict]:
    """The process computes with the lab peers' torch threads: a kernel's floats may depend on how
    many threads split it (the lab shares the cores among its `stage_peers`, one per stage unless
    the run started replicas, and the trainer)."""
    cfg = load_config(config, overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(peer_threads((stage_peers or cfg.model.num_stages) + 1))
    try:
        return local_rows(cfg, tmp_path, steps=steps)
    finally:
        torch.set_num_threads(threads)


def assert_losses_of_one_process(
    results,
    config,
    overrides: list[str],
    tmp_path,
    steps: int,
    stage_peers: int | None = None,
    reference: Future | None = None,
) -> None:
    """A lab's results file holds steps 1..`steps` once each, with the losses and evaluations of
    one process on `config` with `overrides`, bit for bit, however replicas split the steps
    (swarm.engine.exactsum). `reference`: that process's run from `one_process_meanwhile` (the
    same arguments), else it runs now."""
    rows = read_results(results)
    if reference is not None:
        theirs = reference.result()
    else:
        theirs = _one_process_rows(config, overrides, tmp_path, steps, stage_peers)
    ours, reference = ([r for r in run if r["type"] == "step"] for run in (rows, theirs))
    assert [r["step"] for r in ours] == [r["step"] for r in reference] == list(range(1, steps + 1))
    for a, b in zip(ours, reference, strict=True):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
    evals, reference_evals = ({r["step"]: r for r in run if r["type"] == "eval"} for run in (rows, theirs))
    assert evals.keys() == reference_evals.keys()
    for step, row in reference_evals.items():
        assert all(evals[step][mode] == row[mode] for mode in ("uncompressed", "compressed")), step


def assert_same_run(ours, theirs, retried: bool = False):
    """`retried`: micro-batches of our run were sent again (a link reset under them), so a step's
    bytes may exceed one process's, never fall short."""
    steps = [r for r in ours if r["type"] == "step"]
    reference = [r for r in theirs if r["type"] == "step"]
    assert len(steps) == len(reference) > 0
    for a, b in zip(steps, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"])
        if not retried:
            assert a["bytes"] == b["bytes"]
            continue
        assert a["bytes"].keys() == b["bytes"].keys() and all(a["bytes"][k] >= n for k, n in b["bytes"].items())
    evals = [r for r in ours if r["type"] == "eval"]
    reference_evals = [r for r in theirs if r["type"] == "eval"]
    assert len(evals) == len(reference_evals) > 0
    for a, b in zip(evals, reference_evals, strict=True):
        for mode in ("uncompressed", "compressed"):
            for key, value in b[mode].items():
                assert a[mode][key] == pytest.approx(value, rel=1e-5)
    ours_summary, their_summary = (next(r for r in rows if r["type"] == "summary") for rows in (ours, theirs))
    if retried:
        ours_bytes, their_bytes = ours_summary["bytes"], their_summary["bytes"]
        assert ours_bytes.keys() == their_bytes.keys() and all(ours_bytes[k] >= n for k, n in their_bytes.items())
    else:
        assert ours_summary["bytes"] == their_summary["bytes"]
    assert ours_summary["state_bytes"] == their_summary["state_bytes"]


def split_batches(cfg, data, steps: int = 3):
    """The first `steps` steps' (MicroBatch, inputs) pairs, as swarm.training.loop.train would make them."""
    from swarm.data import collate
    from swarm.engine.microbatch import Mode
    from swarm.training.loop import split_micro_batches

    train_set = data[0]
    out = []
    for step in range(steps):
        items = [train_set[i] for i in range(step * cfg.train.batch_size, (step + 1) * cfg.train.batch_size)]
        ids, inputs, targets = collate(items)
        out.append(split_micro_batches(step, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, False))
    return out


def stage_errors(capsys, loop, *argv: str) -> list[str]:
    """peers.stage's serve() in this process, for the ways it refuses to start (no subprocess to import torch)."""
    from peers.stage import build_parser, serve

    capsys.readouterr()
    assert loop.run(serve(build_parser().parse_args(["--stage", "0", *argv]))) == 2
    return capsys.readouterr().err.strip().splitlines()
