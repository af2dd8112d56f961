"""`python -m swarm bench oracle`: its verdict and its errors (a full run is shown in docs/configs.md;
tests/lab runs the same comparison for a LoRA decoder on local text)."""

from __future__ import annotations

import math

from swarm.bench.oracle import OracleReport, _eval_diff, format_report
from swarm.cli.main import main


def test_the_verdict_needs_equal_losses_and_evaluations():
    same = OracleReport([2.5, 2.25], [2.5, 2.25], 0.0, 1)
    assert same.same and "the same run, compared bit for bit" in format_report(same)
    off = OracleReport([2.5, 2.25], [2.5, 2.2501], 0.0, 1)
    assert not off.same and off.loss_diff > 1e-5 and "NOT the same run" in format_report(off)
    # the last bit: not the same run, unless a tolerance (for nondeterministic kernels) is asked for
    ulp = OracleReport([2.5, math.nextafter(2.25, 3)], [2.5, 2.25], 0.0, 1)
    assert not ulp.same and 0 < ulp.loss_diff < 1e-15
    loose = OracleReport(ulp.swarm, ulp.single, 0.0, 1, tolerance=1e-5)
    assert (
        loose.same and "within 1e-05 relative" in format_report(loose) and "not deterministic" in format_report(loose)
    )
    assert not OracleReport([2.5], [2.5], 1e-17, 1).same  # an evaluation a bit off
    assert OracleReport([2.5], [2.5], 1e-7, 1, tolerance=1e-5).same
    assert not OracleReport([2.5], [2.5, 2.25], 0.0, 1).same  # a step missing
    assert not OracleReport([], [], 0.0, 1).same  # nothing ran
    assert not OracleReport([2.5], [2.5], 1e-3, 1).same  # an evaluation differs
    ours = [{"type": "eval", "uncompressed": {"loss": 2.0, "accuracy": 0.5}}]
    assert _eval_diff(ours, ours) == 0.0
    assert _eval_diff(ours, [{"type": "eval", "uncompressed": {"loss": 2.0, "accuracy": 0.25}}]) == 1.0
    assert _eval_diff(ours, []) == float("inf")


def test_a_bad_config_is_one_line(tmp_path, capsys):
    assert main(["bench", "oracle", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config file") and err.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: transformers, options: {config: {model_type: llama, hiden_size: 3}}}\n")
    assert main(["bench", "oracle", str(bad), "--set", "train.bogus=1"]) == 2
    assert "train.bogus" in capsys.readouterr().err
    assert main(["bench", "oracle", str(bad), "--tolerance", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: --tolerance -1.0: a relative difference")
