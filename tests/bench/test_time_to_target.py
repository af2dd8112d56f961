"""bench time-to-target: training seconds without the evaluations, a variant's overrides, steps to
the target from one process (kept and reused), T, the target lines, the table, plot and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.bench.lab_seconds import reaching, training_seconds
from swarm.bench.target_estimate import TimeRow
from swarm.bench.target_steps import StepRuns, Steps, Variant, steps_against
from swarm.bench.time_to_target_table import format_rows, from_json, plot, target_lines, to_json
from swarm.cli.main import main
from swarm.config import load_config
from swarm.config.target import Target


def _run(evals: dict[int, float], step_s: float = 1.0, eval_s: float = 5.0) -> list[dict]:
    """Rows of a run whose steps take `step_s` and whose evaluations (at the given steps, with these
    losses) take `eval_s`, each row's time_s the wall time since the start."""
    rows, now = [{"type": "config"}], 0.0
    for step in range(1, max(evals) + 1):
        now += step_s
        rows.append({"type": "step", "step": step, "samples": 8 * step, "time_s": now, "loss": 4.0 - step / 10})
        if step in evals:
            now += eval_s
            rows.append(
                {"type": "eval", "step": step, "uncompressed": {"loss": evals[step]}, "time_s": now, "eval_s": eval_s}
            )
    return rows


def test_training_seconds_leave_the_evaluations_out_and_steps_count_to_the_first_evaluation_at_the_target():
    run = _run({2: 3.0, 4: 2.5, 6: 1.9})
    rows = training_seconds(run)
    assert [r["time_s"] for r in rows if r["type"] == "step"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [r["time_s"] for r in rows if r["type"] == "eval"] == [2.0, 4.0, 6.0]
    curve, first = reaching(run, Target.parse("loss=2.0"))
    assert curve == [[2.0, 2, 3.0], [4.0, 4, 2.5], [6.0, 6, 1.9]] and first["step"] == 6
    went = steps_against(run, Target.parse("loss=2.6"))
    assert (went.reached, went.steps_to_target, went.steps, went.final) == (True, 4, 6, 1.9)
    assert went.curve == [[2, 3.0], [4, 2.5], [6, 1.9]] and went.losses == [3.9, 3.8, 3.7, 3.6, 3.5, 3.4]
    missed = steps_against(run, Target.parse("loss=1.0"))
    assert not missed.reached and missed.steps_to_target is None
    with pytest.raises(ValueError, match="the evaluations report loss, not accuracy"):
        steps_against(run, Target.parse("accuracy=0.5"))


def test_a_variant_is_its_overrides():
    assert Variant("muon", "async", "quant:4").overrides() == [
        "optimizer.name=muon",
        "train.schedule=async",
        "compression.forward=quant:4",
        "compression.backward=quant:4",
    ]
    adamw = load_config(
        "configs/bench/time-to-target.yaml", Variant("adamw:0.002", "async:none", "torch:gloo").overrides()
    )
    assert (adamw.optimizer.name, adamw.optimizer.lr, adamw.optimizer.adamw_lr) == ("adamw", 0.002, None)
    assert (adamw.train.schedule, adamw.train.delay_correction, adamw.compression.forward) == ("async", "none", "none")
    with pytest.raises(ValueError, match="sync only"):
        Variant("muon", "async", "torch:gloo").check()
    with pytest.raises(ValueError, match="expected sync, async"):
        Variant("muon", "later", "none").check()


@pytest.mark.peers
def test_one_process_runs_are_kept_and_reused_for_the_same_config_only(tmp_path):
    lines = []
    runs = StepRuns("configs/smoke.yaml", ["train.max_steps=2", "train.eval_every=0.1"], tmp_path, lines.append)
    sgd = Variant("sgd", "sync", "none")
    first = runs.steps([sgd, sgd], Target.parse("loss=2.0"))
    assert list(first) == [sgd] and first[sgd].steps == 2 and len(first[sgd].losses) == 2
    kept = sorted(tmp_path.glob("*.jsonl"))
    assert len(kept) == 1
    again = StepRuns("configs/smoke.yaml", ["train.max_steps=2", "train.eval_every=0.1"], tmp_path, lines.append)
    assert again.steps([sgd], Target.parse("loss=2.0"))[sgd].losses == first[sgd].losses
    assert sorted(tmp_path.glob("*.jsonl")) == kept and "kept in" in lines[-1]
    wider = StepRuns("configs/smoke.yaml", ["train.max_steps=2", "train.eval_every=0.1", "train.in_flight=3"], tmp_path)
    assert wider.path(sgd) == kept[0]  # the window only a swarm reads: the same one-process run
    again.steps([Variant("sgd", "async", "none")], Target.parse("loss=2.0"))  # another config: another run
    assert len(list(tmp_path.glob("*.jsonl"))) == 2


def _row(schedule: str, codec: str, steps: int | None, step_s: float, optimizer: str = "muon", **more) -> TimeRow:
    fields = dict(
        optimizer=optimizer,
        schedule=schedule,
        codec=codec,
        backward="none" if codec == "torch:gloo" else codec,
        bandwidth_mbit=10,
        delay_ms=50,
        target="loss<=1.8",
        reached=steps is not None,
        steps_to_target=steps,
        steps=1000,
        final_metric=1.6,
        step_seconds=step_s,
        T=steps * step_s if steps is not None else None,
        samples_per_s=32 / step_s,
        fraction_of_bound=0.9,
        binding="link stage1 up",
        oracle_gap=0.0,
    )
    return TimeRow(**{**fields, **more})


def test_target_lines_weigh_asynchronous_steps_the_best_T_and_a_real_run():
    rows = [
        _row("sync", "none", 540, 4.0),
        _row("async", "none", 530, 2.5),
        _row("sync", "quant:4", 600, 0.8),
        _row("async", "quant:4", 630, 0.4),
        _row("sync", "torch:gloo", 540, 4.4),
        _row("async", "quant:4", 630, 0.4, kind="real", measured_seconds=270.0),
    ]
    lines = target_lines(rows)
    assert lines[0] == (
        "muon at 10 Mbit/s, 50 ms: async needs 530 steps to loss<=1.8, synchronous 540: 0.98x (target <= 1.1x: met)"
    )
    assert lines[1].startswith(
        "muon at 10 Mbit/s, 50 ms: async quant:4 reaches loss<=1.8 in 252 s, 8.57x sooner than uncompressed synchronous"
    )
    assert lines[1].endswith("(2160 s; target >= 4x: met)")
    assert "9.43x sooner than torch:gloo" in lines[2]
    assert lines[3].endswith("measured 270 s to the target in the lab, T = 252 s: 7% apart (target <= 10%: met)")
    slow = target_lines([_row("sync", "none", 540, 1.0), _row("async", "none", 700, 0.9)])
    assert slow[0].endswith("1.30x (target <= 1.1x: missed (1.30x against 1.1x))")
    assert (
        slow[1]
        == "muon at 10 Mbit/s, 50 ms: uncompressed synchronous is the soonest to loss<=1.8 (540 s; target >= 4x: missed)"
    )
    never = target_lines([_row("sync", "none", None, 4.0), _row("async", "quant:4", 600, 0.5)])
    assert (
        never[0] == "muon at 10 Mbit/s, 50 ms: uncompressed synchronous did not reach loss<=1.8; async quant:4 in 300 s"
    )
    table = format_rows(rows).splitlines()
    assert table[0].split() == [
        "optimizer",
        "schedule",
        "codec",
        "Mbit/s",
        "delay",
        "ms",
        "steps",
        "s/step",
        "T",
        "s",
        "samples/s",
        "bound",
        "oracle",
    ]
    assert "(measured 270)" in table[-1] and table[1].split()[5:8] == ["540", "4.000", "2160"]


def test_rows_round_trip_through_json_and_plot(tmp_path):
    rows = [_row("sync", "none", 540, 4.0), _row("async", "quant:4", None, 0.4)]
    assert from_json(to_json(rows)) == rows
    keys = set(json.loads(to_json(rows))[0])
    assert {
        "optimizer",
        "schedule",
        "codec",
        "bandwidth_mbit",
        "delay_ms",
        "steps_to_target",
        "step_seconds",
        "T",
        "reached",
    } <= keys
    steps = {r.variant: Steps(r.reached, r.steps_to_target, 1000, 1.6, [[10, 3.0], [540, 1.8]]) for r in rows}
    path = tmp_path / "ttt.png"
    plot(rows, steps, str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_json_rows_load():
    text = (Path(__file__).parents[2] / "docs" / "bench" / "time-to-target.json").read_text()
    rows = from_json(text)
    assert rows and json.loads(to_json(rows)) == json.loads(text)
    assert all(r.T is None or r.T == pytest.approx(r.steps_to_target * r.step_seconds) for r in rows)


@pytest.mark.parametrize(
    "args",
    [
        ["--target", "loss~2"],
        ["--bandwidth", "fast"],
        ["--codecs", "zip:9"],
        ["--delays", "soon"],
        ["--schedules", "async:x"],
    ],
)
def test_bad_values_get_one_line_errors(args, capsys):
    assert main(["bench", "time-to-target", "configs/smoke.yaml", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
