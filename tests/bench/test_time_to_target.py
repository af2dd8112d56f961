"""bench time-to-target: training seconds without the evaluations, the first evaluation at the
target, the table and target lines; and the whole benchmark on a small config, hivepipe and
torch.distributed side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.bench.points import Achieved, Point
from swarm.bench.time_to_target import Reaching, TargetRow, reaching, training_seconds
from swarm.bench.time_to_target_table import format_rows, from_json, plot, sooner_than, target_lines, to_json
from swarm.cli.main import main
from swarm.config.target import Target


def _run(evals: dict[int, float], step_s: float = 1.0, eval_s: float = 5.0) -> list[dict]:
    """Rows of a run whose steps take `step_s` and whose evaluations (at the given steps, with these
    losses) take `eval_s`, each row's time_s the wall time since the start."""
    rows, now = [{"type": "config"}], 0.0
    for step in range(1, max(evals) + 1):
        now += step_s
        rows.append({"type": "step", "step": step, "samples": 8 * step, "time_s": now})
        if step in evals:
            now += eval_s
            rows.append(
                {"type": "eval", "step": step, "uncompressed": {"loss": evals[step]}, "time_s": now, "eval_s": eval_s}
            )
    return rows


def test_training_seconds_leave_the_evaluations_out():
    run = _run({2: 3.0, 4: 2.5, 6: 1.9})
    rows = training_seconds(run)
    assert [r["time_s"] for r in rows if r["type"] == "step"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [r["time_s"] for r in rows if r["type"] == "eval"] == [2.0, 4.0, 6.0]
    rows = run
    curve, first = reaching(rows, Target.parse("loss=2.0"))
    assert curve == [[2.0, 2, 3.0], [4.0, 4, 2.5], [6.0, 6, 1.9]] and first["step"] == 6
    assert reaching(rows, Target.parse("loss=1.0"))[1] is None
    with pytest.raises(ValueError, match="the evaluations report loss, not accuracy"):
        reaching(rows, Target.parse("accuracy=0.5"))


def _row(
    codec: str, seconds: float | None, samples_per_s: float, mbit: float = 10, train_seconds: float = 100.0
) -> TargetRow:
    reached = seconds is not None
    went = Reaching(
        "loss<=2", reached, 10 if reached else None, seconds, 20, train_seconds, 2.1, [[1.0, 1, 3.0], [2.0, 2, 2.5]]
    )
    point = Point(codec, "none", mbit, delay_ms=50)
    return TargetRow(point, Achieved(samples_per_s, 5.0, 20.0, 0.9, "link stage1 up"), went)


def test_target_lines_compare_the_best_codec_with_none_and_none_with_gloo():
    rows = [
        _row("none", 80.0, 4.0),
        _row("topk:0.1", 16.0, 20.0),
        _row("quant:4", 40.0, 8.0),
        _row("torch:gloo", 90.0, 3.6),
    ]
    lines = target_lines(rows)
    assert lines[0] == "at 10 Mbit/s, 50 ms: topk:0.1 reached loss<=2 5.00x sooner than none (target >= 4x: met)"
    assert lines[1].startswith(
        "at 10 Mbit/s, 50 ms: none 4.0 samples/s against torch:gloo 3.6, 1.11x (target >= 1x: met)"
    )
    assert lines[1].endswith("to the target 80.0s against gloo's 90.0s")
    slow = [_row("none", 80.0, 4.0), _row("topk:0.1", 40.0, 8.0), _row("torch:gloo", 50.0, 8.0)]
    assert target_lines(slow)[0].endswith("2.00x sooner than none (target >= 4x: missed by 50%)")
    assert "0.50x (target >= 1x: missed by 50%)" in target_lines(slow)[1]
    # none never got there: what it trained is a lower bound on its time
    missed = [_row("none", None, 4.0, train_seconds=200.0), _row("topk:0.1", 20.0, 8.0)]
    assert sooner_than(missed[1], missed[0]) == 10.0 and "(at least: none did not reach it)" in target_lines(missed)[0]
    table = format_rows(rows).splitlines()
    assert table[0].split()[:3] == ["codec", "backward", "Mbit/s"] and len(table) == 5
    assert table[2].split()[-1] == "5.00" and table[1].split()[-1] == "-"


def test_the_plot_has_a_panel_per_bandwidth(tmp_path):
    path = tmp_path / "ttt.png"
    plot([_row("none", 80.0, 4.0), _row("none", 30.0, 9.0, mbit=20), _row("torch:gloo", 90.0, 3.6)], str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_json_rows_load_and_write_back_the_same_flat_keys_and_values():
    text = (Path(__file__).parents[2] / "docs" / "bench" / "time-to-target.json").read_text()
    rows = from_json(text)
    assert rows and json.loads(to_json(rows)) == json.loads(text)
    assert json.loads(to_json([_row("none", 80.0, 4.0)]))[0]["seconds_to_target"] == 80.0


@pytest.mark.parametrize(
    "args", [["--target", "loss~2"], ["--bandwidth", "fast"], ["--codecs", "zip:9"], ["--delay", "soon"]]
)
def test_bad_values_get_one_line_errors(args, capsys):
    assert main(["bench", "time-to-target", "configs/smoke.yaml", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
