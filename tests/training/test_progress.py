"""A run's progress from its results rows: the pace over the last steps, time left, rewinds."""

from __future__ import annotations

from swarm.training.progress import RunProgress, format_duration
from swarm.training.results import ResultsWriter


def _step(step: int, time_s: float, batch: int = 10) -> dict:
    return {"type": "step", "step": step, "samples": step * batch, "loss": 1.0 / step, "lr": 0.1, "time_s": time_s}


def test_pace_and_time_left_come_from_the_last_steps():
    progress = RunProgress(total_steps=100, window=4)
    assert progress.samples_per_s == 0.0 and progress.eta_s is None
    for step in range(1, 11):  # 1 s per step at first, then 0.5 s
        progress.observe(_step(step, step if step <= 5 else 5 + (step - 5) * 0.5))
    assert progress.samples_per_s == 20.0  # the window holds only the fast steps
    assert progress.eta_s == 90 * 0.5
    assert progress.snapshot()["loss"] == 0.1
    assert "step 10/100:" in progress.line() and "20.0 samples/s" in progress.line() and "0m45s left" in progress.line()


def test_a_rewind_restarts_the_pace_and_evaluations_are_kept():
    writer = ResultsWriter(None)
    progress = RunProgress(total_steps=10)
    writer.listeners.append(progress.observe)
    for step in range(1, 5):
        writer.write(_step(step, float(step)))
    writer.write({"type": "eval", "step": 4, "uncompressed": {"accuracy": 0.5}})
    writer.rewind(2)
    assert progress.step == 2 and progress.samples_per_s == 0.0
    writer.write(_step(3, 10.0))
    writer.write(_step(4, 12.0))
    assert progress.samples_per_s == 5.0 and progress.evaluation == {"accuracy": 0.5}


def test_durations_read_like_a_clock():
    assert [format_duration(s) for s in (5, 65, 3600 + 125)] == ["0m05s", "1m05s", "1h02m"]


def test_on_a_terminal_the_bar_shows_step_loss_samples_per_second_and_time_left(capsys):
    from _util import SMOKE

    from swarm.config import load_config
    from swarm.training.experiment import run_experiment

    run_experiment(load_config(SMOKE, ["train.eval_every=100"]), None, 4, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "4/4" in bar and "loss" in bar and "samples/s=" in bar and "<00:00" in bar, bar
