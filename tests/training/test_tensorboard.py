"""`--tensorboard DIR`: event files whose scalars are the results rows' (read back with
TensorBoard's own reader); the swarm trainer's: tests/export/test_export_swarm.py."""

from __future__ import annotations

from _export_cases import assert_tensorboard_has_the_rows, tensorboard_scalars
from _util import SMOKE, cli_here

from swarm.training.results import read_results
from swarm.training.tensorboard import TensorBoardRows


def test_swarm_run_writes_the_results_rows_as_tensorboard_scalars(tmp_path, capsys):
    results, board = tmp_path / "run.jsonl", tmp_path / "tb"
    done = cli_here(
        capsys, "run", str(SMOKE), "--steps", "3", "--results", str(results), "--tensorboard", str(board),
        "--set", "train.eval_every=0.05",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_tensorboard_has_the_rows(board, read_results(results))


def test_adaptive_codecs_name_the_bytes_of_each_step_and_a_step_written_again_keeps_its_newest_values(tmp_path):
    board = TensorBoardRows(str(tmp_path))
    config = {"model": {"num_stages": 2}, "compression": {"forward": "topk:0.1", "backward": "topk:reuse"}}
    board.observe({"type": "config", "config": config})
    step = {"type": "step", "loss": 2.0, "lr": 0.1, "epoch": 0.1, "samples": 8, "time_s": 1.0}
    board.observe({**step, "step": 1, "bytes": {"boundary0.forward.train": 100}})
    board.observe(
        {**step, "step": 2, "bytes": {"boundary0.forward.train": 50}, "codecs": {"0": ["quant:4", "quant:4"]}}
    )
    board.observe({"type": "rewind", "step": 1})  # a swarm went back to its copies of step 1
    board.observe({**step, "step": 2, "loss": 1.5, "samples": 16, "time_s": 3.0, "bytes": {}})
    board.close()
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["bytes/boundary0.forward (topk:0.1)"] == {1: 100.0}
    assert scalars["bytes/boundary0.forward (quant:4)"] == {2: 50.0}
    assert scalars["train/loss"] == {1: 2.0, 2: 1.5}
    assert scalars["train/samples_per_s"] == {1: 8.0, 2: 4.0}  # after step 1's row again: 8 samples in 2 s
