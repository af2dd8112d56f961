"""Per-stage checkpoints: state tables round-trip, and a resumed run repeats an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from _util import SMOKE

from protocols import wire
from swarm.compression import parse
from swarm.compression.state import GlobalState, SampleStore
from swarm.config import load_config
from swarm.engine.checkpoint import load_stage, save_stage
from swarm.training.checkpoints import Checkpointing, latest_run
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter, read_results
from swarm.transport.local import build_local_pipeline


def _losses(rows) -> list[float]:
    return [r["loss"] for r in rows if r["type"] == "step"]


def test_global_state_round_trips_buffers_and_versions():
    table = GlobalState()
    table.save(None, torch.randn(3, 4), (5,))
    copy = GlobalState()
    copy.load_state_dict(table.state_dict())
    a, va = table.load((3, 4), None, "cpu")
    b, vb = copy.load((3, 4), None, "cpu")
    assert torch.equal(a, b) and va == vb == (5,)
    with pytest.raises(ValueError, match="per-sample"):
        SampleStore().load_state_dict(table.state_dict())


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_sample_store_round_trips_rows_slots_and_versions(fmt):
    store = SampleStore(fmt)
    store.save([7, 3, 11], torch.randn(3, 2, 5), (1, 2, 3))
    store.save([3, 20], torch.randn(2, 2, 5), (4, 1))
    copy = SampleStore(fmt)
    copy.load_state_dict(store.state_dict())
    ids = [20, 11, 3, 7, 99]
    a, va = store.load((5, 2, 5), ids, "cpu")
    b, vb = copy.load((5, 2, 5), ids, "cpu")
    assert torch.equal(a, b) and va == vb == (1, 3, 4, 1, 0)
    copy.save([99], torch.ones(1, 2, 5), (1,))  # grows after loading
    assert copy.samples == 5 and store.samples == 4


def test_disk_store_keeps_rows_in_place_and_refuses_changed_rows(tmp_path):
    path = tmp_path / "rows.npy"
    store = SampleStore("fp16", path, capacity=8)
    store.save([4, 2], torch.randn(2, 6), (1, 1))
    state = store.state_dict()
    assert "rows" not in state and state["path"] == str(path)
    copy = SampleStore("fp16", path, capacity=8)
    copy.load_state_dict(state)
    assert torch.equal(copy.load((2, 6), [2, 4], "cpu")[0], store.load((2, 6), [2, 4], "cpu")[0])
    store.save([4], torch.randn(1, 6), (2,))  # the run went on after the checkpoint
    with pytest.raises(ValueError, match="changed since this checkpoint"):
        SampleStore("fp16", path, capacity=8).load_state_dict(state)


def test_sender_receiver_state_round_trips_and_mismatch_is_refused():
    spec = parse("topk:0.3+ef21")
    sender, receiver = spec.sender(), spec.receiver()
    for _ in range(2):
        out = sender.send(torch.randn(4, 10))
        receiver.receive(wire.decode(out.payload)).commit()
        out.commit()
    s2, r2 = spec.sender(), spec.receiver()
    s2.load_state_dict(sender.state_dict())
    r2.load_state_dict(receiver.state_dict())
    x = torch.randn(4, 10)
    assert s2.send(x).payload == sender.send(x).payload  # same state, same versions in the stamp
    assert torch.equal(
        r2.receive(wire.decode(sender.send(x).payload)).tensor,
        receiver.receive(wire.decode(sender.send(x).payload)).tensor,
    )
    with pytest.raises(ValueError, match="error-feedback state"):
        parse("topk:0.3").sender().load_state_dict(sender.state_dict())


def test_stage_file_round_trips_and_checks_the_link(tmp_path):
    cfg = load_config(SMOKE, ["compression.forward=topk:0.2+ef21"])
    pipeline, _ = build_local_pipeline(cfg, total_steps=10)
    runtime = pipeline.runtimes[1]
    save_stage(runtime, pipeline.ends[1], tmp_path / "s1.pt", 7)
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed into place
    other, _ = build_local_pipeline(load_config(SMOKE, ["compression.forward=topk:0.2+ef21", "seed=1"]), total_steps=10)
    assert load_stage(other.runtimes[1], other.ends[1], tmp_path / "s1.pt") == 7
    for a, b in zip(runtime.module.parameters(), other.runtimes[1].module.parameters(), strict=True):
        assert torch.equal(a, b)
    changed, _ = build_local_pipeline(load_config(SMOKE, ["compression.forward=topk:0.2"]), total_steps=10)
    before = [p.clone() for p in changed.runtimes[1].module.parameters()]
    with pytest.raises(ValueError, match="specs"):
        load_stage(changed.runtimes[1], changed.ends[1], tmp_path / "s1.pt")
    for a, b in zip(before, changed.runtimes[1].module.parameters(), strict=True):  # refused before loading anything
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="stage 1/4"):
        load_stage(changed.runtimes[2], changed.ends[2], tmp_path / "s1.pt")


class _Crash(RuntimeError):
    pass


class _CrashingPipeline:
    """Delegates to a pipeline and dies inside step `at` (after its micro-batches ran)."""

    def __init__(self, pipeline, at: int) -> None:
        self._pipeline, self._at, self._steps = pipeline, at, 0

    def __getattr__(self, name):
        return getattr(self._pipeline, name)

    def step(self):
        self._steps += 1
        if self._steps == self._at:
            raise _Crash
        return self._pipeline.step()


def _run(cfg, directory=None, every=None, crash_at=None, steps=6) -> list[dict]:
    data = build_data(cfg)
    schedule = Schedule.of(cfg, len(data[0]), steps)
    pipeline, _ = build_local_pipeline(cfg, schedule.lr_horizon, capacity=len(data[0]))
    if crash_at is not None:
        pipeline = _CrashingPipeline(pipeline, crash_at)
    results = ResultsWriter(None)
    checkpoint = Checkpointing(str(directory), every) if directory is not None else None
    try:
        train(cfg, pipeline, data, results, steps, progress=False, checkpoint=checkpoint)
    except _Crash:
        pass
    return results.rows


@pytest.mark.parametrize(
    ("overrides", "steps", "crash_at"),
    [
        (["compression.forward=topk:0.2+ef21", "compression.backward=topk:reuse"], 6, 4),
        # 5 steps per epoch: the checkpoint at step 6 sits inside the second epoch's data order
        (
            [
                "compression.forward=topk:0.3+aqsgd",
                "compression.backward=topk:0.3+ef",
                "train.batch_size=80",
                "train.epochs=2",
            ],
            8,
            8,
        ),
        # stochastic rounding draws from the global RNG, which the checkpoint restores
        (["compression.forward=quant:3/stochastic", "compression.backward=quant:4/stochastic"], 6, 5),
        # Muon's momentum and AdamW's moments, and the look-ahead's last move, all in the checkpoint
        (
            [
                "compression.forward=quant:4",
                "compression.backward=quant:4",
                "optimizer={name: muon, lr: 0.02}",
                "train.schedule=async",
            ],
            7,
            5,
        ),
    ],
    ids=["ef21-reuse", "aqsgd-ef-epochs", "stochastic", "muon-async"],
)
def test_resumed_run_repeats_the_uninterrupted_run(tmp_path, overrides, steps, crash_at, capsys):
    cfg = load_config(SMOKE, overrides)
    whole = _run(cfg, steps=steps)
    saved = (crash_at - 1) // 3 * 3
    first = _run(cfg, tmp_path, every=3, crash_at=crash_at, steps=steps)
    assert _losses(first) == _losses(whole)[: crash_at - 1]
    assert latest_run(tmp_path).name == f"step-{saved:08d}"
    resumed = _run(cfg, tmp_path, every=3, steps=steps)
    assert "resuming from checkpoint" in capsys.readouterr().err
    assert [r["step"] for r in resumed if r["type"] == "step"] == list(range(saved + 1, steps + 1))
    assert _losses(resumed) == _losses(whole)[saved:]  # bit-identical, not merely close
    assert resumed[-1]["bytes"] == whole[-1]["bytes"] and resumed[-1]["samples"] == whole[-1]["samples"]
    assert resumed[-1]["state_bytes"] == whole[-1]["state_bytes"]
    assert whole[-1]["state_bytes"] > 0 or "+" not in overrides[0]
    assert resumed[-1]["best"] == whole[-1]["best"]  # evaluations before the checkpoint count


def test_incomplete_checkpoint_is_ignored(tmp_path):
    cfg = load_config(SMOKE, [])
    _run(cfg, tmp_path, every=2, steps=2)
    (tmp_path / "step-00000004").mkdir()  # a crash mid-save: no trainer.pt
    (tmp_path / ".step-00000006.123.tmp").mkdir()
    assert latest_run(tmp_path).name == "step-00000002"


def test_cli_resume_rewinds_the_results_file(tmp_path):
    cfg = load_config(SMOKE, ["compression.forward=topk:0.2+ef21"])
    results = tmp_path / "r.jsonl"
    run_experiment(cfg, results, 4, progress=False, checkpoint=Checkpointing(str(tmp_path / "ck"), 2))
    rows = read_results(results)
    for d in (tmp_path / "ck").glob("step-00000004"):  # as if the run had died after step 3
        import shutil

        shutil.rmtree(d)
    run_experiment(cfg, results, 4, progress=False, checkpoint=Checkpointing(str(tmp_path / "ck"), 2))
    again = read_results(results)
    assert [r["type"] for r in again].count("config") == 1
    assert [r["step"] for r in again if r["type"] == "step"] == [1, 2, 3, 4]
    assert _losses(again) == _losses(rows)
