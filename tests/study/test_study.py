"""`python -m swarm study` (skip finished runs, resume a partial one) and the study report."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from _study_configs import write_tiny_configs
from _util import REPO

from swarm.cli import main
from swarm.config import load_config
from swarm.study.entries import discover, same_config, status
from swarm.study.findings import Row, Study, check_all, gradients_more_sensitive, independent_topk_diverges
from swarm.study.report import write_study_report
from swarm.study.rerun import compare
from swarm.study.runner import StudyLocked, StudyOutput, _lock, run_study
from swarm.study.runs import load_run
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import train
from swarm.training.results import ResultsWriter, read_results


def write_configs(directory: Path) -> Path:
    rows = [
        ("a-base", "none", "none", "No compression", 93.0, 93.0),
        ("b-top20", "topk:0.2", "topk:0.2", "Top 20%", 86.74, 92.73),
        ("c-top10", "topk:0.1", "topk:0.1", "Top 10%", 75.89, 91.87),
    ]
    return write_tiny_configs(directory, rows)


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_results(path) if r["type"] == "step"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """a-base finished by the study, b-top20 killed at step 6 of 12 then resumed, c-top10 never run."""
    base = tmp_path_factory.mktemp("study")
    configs = write_configs(base / "configs")
    results = base / "runs"
    log = io.StringIO()
    assert run_study(configs, results, only=["a-base"], output=StudyOutput(heartbeat=0, progress=False, out=log)) == 0
    first_a = (results / "a-base.jsonl").read_text()

    # b-top20: killed while logging step 6 (checkpoints come with every evaluation, every 4 steps)
    class Killed(RuntimeError):
        pass

    write = ResultsWriter.write

    def dying_write(self, row):
        if row.get("type") == "step" and row["step"] == 6:
            raise Killed("killed at step 6")
        write(self, row)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ResultsWriter, "write", dying_write)
        log = io.StringIO()
        assert (
            run_study(configs, results, only=["b-top20"], output=StudyOutput(heartbeat=0, progress=False, out=log)) == 1
        )
    assert "b-top20: FAILED (Killed: killed at step 6); its checkpoints are kept" in log.getvalue()
    entry = next(e for e in discover(configs, results) if e.name == "b-top20")
    partial_state = status(entry)

    # the same run uninterrupted, for comparison
    reference = base / "reference.jsonl"
    run_experiment(load_config(configs / "b-top20.yaml"), reference, progress=False)

    log = io.StringIO()
    assert (
        run_study(
            configs, results, only=["a-base", "b-top20"], output=StudyOutput(heartbeat=0, progress=False, out=log)
        )
        == 0
    )
    return {
        "configs": configs,
        "results": results,
        "log": log.getvalue(),
        "first_a": first_a,
        "partial": partial_state,
        "reference": reference,
    }


def test_study_skips_finished_runs_and_resumes_a_partial_one(study):
    results, log = study["results"], study["log"]
    assert study["partial"].state == "partial" and study["partial"].steps == 5
    assert "2 runs, 1 finished, 1 to run" in log
    assert "b-top20: resuming (resumes from step-00000004" in log
    assert "a-base" not in log.split("to run;")[1]  # never started again
    assert (results / "a-base.jsonl").read_text() == study["first_a"]
    # the resumed run logs every step once, with exactly the losses of the uninterrupted run
    assert losses(results / "b-top20.jsonl") == losses(study["reference"])
    assert [r["type"] for r in read_results(results / "b-top20.jsonl")].count("summary") == 1
    assert not (results / "checkpoints" / "b-top20").exists()  # deleted once finished
    states = {e.name: status(e).state for e in discover(study["configs"], results)}
    assert states == {"a-base": "finished", "b-top20": "finished", "c-top10": "pending"}


def test_a_changed_config_is_stale_and_a_second_study_is_refused(study, tmp_path):
    configs = write_configs(tmp_path / "configs")
    for name in ("a-base", "b-top20"):
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / f"{name}.jsonl").write_text((study["results"] / f"{name}.jsonl").read_text())
    path = configs / "a-base.yaml"
    path.write_text(path.read_text().replace("lr: 0.1", "lr: 0.2"))
    states = {e.name: status(e).state for e in discover(configs, tmp_path / "runs")}
    assert states == {"a-base": "stale", "b-top20": "finished", "c-top10": "pending"}
    held = _lock(tmp_path / "runs")
    try:
        with pytest.raises(StudyLocked, match="in use by a running study"):
            run_study(configs, tmp_path / "runs", output=StudyOutput(heartbeat=0, progress=False, out=io.StringIO()))
    finally:
        held.close()


def test_only_patterns_and_status_command(study, capsys):
    assert [e.name for e in discover(study["configs"], study["results"], only=["top"])] == ["b-top20", "c-top10"]
    assert [e.name for e in discover(study["configs"], study["results"], only=["a-*"])] == ["a-base"]
    assert main(["study", str(study["configs"]), "--results_dir", str(study["results"]), "--status"]) == 0
    out = capsys.readouterr().out
    assert "3 runs: 2 finished, 1 pending" in out
    assert out.splitlines()[1].startswith("finished  b-top20")


def test_study_report_puts_paper_and_measured_figures_side_by_side(study, tmp_path):
    written = write_study_report(study["configs"], study["results"], tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    summary = read_results(study["results"] / "b-top20.jsonl")[-1]
    ours = 100 * summary["best"]["compressed"]["accuracy"]
    row = next(line for line in md.splitlines() if line.startswith("| Top 20% |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert f"{ours:.2f}†" in cells and "92.73" in cells and "86.74" in cells  # ours (one seed) and the paper's, one row
    per_sample = sum(summary["bytes_per_sample"].values()) / 1024
    assert f"{per_sample:.1f}" in cells
    pending = next(line for line in md.splitlines() if line.startswith("| Top 10% |"))
    assert pending.rstrip(" |").endswith("pending") and "91.87" in pending
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "2 of 3 runs finished" in readme and "not finished yet: c-top10" in readme
    assert "## What holds at this scale" in readme
    assert any(p.suffix == ".png" and p.stat().st_size > 1000 for p in written)


def _three_seeds(mean: float, spread: float) -> list[float]:
    """Three seeds with mean `mean` and standard deviation `spread`."""
    return [mean - spread, mean, mean + spread]


def _quant_row(fw: int, bw: int, acc: float, spread: float = 0.5) -> Row:
    seeds = _three_seeds(acc, spread)
    return Row(
        f"fw{fw}-bw{bw}",
        "resnet18",
        f"quant:{fw}/tensor",
        f"quant:{bw}/tensor",
        finished=True,
        acc_off=acc,
        acc_on=acc,
        seeds={"acc_on": seeds, "acc_off": seeds},
    )


def test_findings_are_judged_against_the_spread():
    # gradient-heavy splits win by more than 2 x the pooled std (1.0) in both measured pairs; the third is pending
    rows = [_quant_row(4, 2, 40.0), _quant_row(2, 4, 50.0), _quant_row(4, 4, 45.0), _quant_row(2, 6, 52.0)]
    finding = gradients_more_sensitive(Study(rows))
    assert finding.verdict == "holds (so far)" and "pending: fw4-bw6, fw2-bw8" in finding.ours
    assert "+10.00 (noise ±1.00, n 3)" in finding.ours  # the comparison that decided it
    rows[1] = _quant_row(2, 4, 30.0)  # one clearly better, one clearly worse
    assert gradients_more_sensitive(Study(rows)).verdict == "mixed (so far)"
    rows[1], rows[3] = _quant_row(2, 4, 38.0), _quant_row(2, 6, 43.0)  # both worse by 2 > noise 1
    assert gradients_more_sensitive(Study(rows)).verdict == "does not hold (so far)"
    # the same differences with a spread of 3 points a seed (noise 6): within noise
    wide = [_quant_row(4, 2, 40.0, 3), _quant_row(2, 4, 45.0, 3), _quant_row(4, 4, 45.0, 3), _quant_row(2, 6, 50.0, 3)]
    assert gradients_more_sensitive(Study(wide)).verdict == "within noise (so far)"
    # one seed: no spread, not judged (the lean with the fixed 2-point guess given)
    single = [Row(r.name, r.model, r.forward, r.backward, finished=True, acc_on=r.acc_on) for r in rows[:2]]
    single[1].acc_on = 50.0
    assert (
        gradients_more_sensitive(Study(single)).verdict
        == "not judged: single seed (holds with the fixed guess) (so far)"
    )

    def lm(loss_separate: float) -> list[Row]:
        return [
            Row(
                "r",
                "gpt2",
                "topk:0.1",
                "topk:reuse",
                finished=True,
                loss_on=6.0,
                seeds={"loss_on": _three_seeds(6.0, 0.1)},
            ),
            Row(
                "s",
                "gpt2",
                "topk:0.1",
                "topk:0.1",
                finished=True,
                loss_on=loss_separate,
                seeds={"loss_on": _three_seeds(loss_separate, 0.1)},
            ),
        ]

    assert independent_topk_diverges(Study(lm(6.05))).verdict == "does not hold"  # +0.05: not 1 nat worse
    assert independent_topk_diverges(Study(lm(8.0))).verdict == "holds"  # +2 nats, noise 0.2
    assert independent_topk_diverges(Study(lm(7.1))).verdict == "within noise"  # +1.1: 1 nat within 0.2
    assert all(f.verdict == "pending" for f in check_all([]))


def test_study_configs_are_generated_and_carry_the_papers_figures():
    generator = REPO / "configs" / "study-cpu" / "generate.py"
    result = subprocess.run([sys.executable, str(generator), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    study = {p.stem: load_config(p) for p in (REPO / "configs" / "study-cpu").glob("*.yaml")}
    paper = [load_config(p) for p in (REPO / "configs" / "paper").glob("*.yaml")]
    tables = {}
    for name, cfg in study.items():
        tables[cfg.report.table.split(":")[0]] = tables.get(cfg.report.table.split(":")[0], 0) + 1
        # "warmup 20%" of our epochs
        row = cfg.report.row.removesuffix("%") if ", warmup " in cfg.report.row else cfg.report.row
        twin = next(p for p in paper if (p.report.table, p.report.row) == (cfg.report.table, row))
        assert cfg.report.paper == twin.report.paper, name
        assert cfg.model.num_stages == 4 and cfg.seed == 0
    assert tables == {"Table 1": 8, "Table 2": 6, "Table 3": 5, "Table 4": 4, "Table 5": 6}


def test_rank_sweep_configs_are_generated_from_the_byte_gpt_config():
    generator = REPO / "configs" / "rank-sweep" / "generate.py"
    result = subprocess.run([sys.executable, str(generator), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    base = load_config(REPO / "configs" / "bench" / "byte-gpt-200.yaml")
    sweep = {p.stem: load_config(p) for p in sorted((REPO / "configs" / "rank-sweep").glob("*.yaml"))}
    codecs = {name: (cfg.compression.forward, cfg.compression.backward) for name, cfg in sweep.items()}
    assert codecs["rank-r0-none"] == ("none", "none")
    ranks = {
        kind: sorted(int(fw.split(":")[1]) for fw, bw in codecs.values() if fw == bw and fw.startswith(kind))
        for kind in ("lowrank", "subspace")
    }
    assert ranks == {"lowrank": [1, 2, 4, 8, 16, 32, 64], "subspace": [2, 8, 32]}
    for cfg in sweep.values():  # only the codec differs from the benchmark's config
        assert cfg.model == base.model and cfg.optimizer == base.optimizer and cfg.train == base.train, cfg.name
        assert len({c.report.table for c in sweep.values()}) == 1


def test_the_papers_own_figures_pass_every_check():
    """The rules behind the verdicts are faithful to the paper: its own tables satisfy them all."""
    rows = []
    for path in sorted((REPO / "configs" / "study-cpu").glob("*.yaml")):
        cfg = load_config(path)
        paper = cfg.report.paper
        rows.append(
            Row(
                cfg.name,
                cfg.model.name,
                cfg.compression.forward,
                cfg.compression.backward,
                cfg.train.warmup_epochs,
                True,
                paper.get("acc_off"),
                paper.get("acc_on"),
                paper.get("eval_loss"),
                paper.get("eval_loss"),
                dict(paper),
                # three seeds a hair apart: the paper's differences are all outside such noise
                {
                    key: _three_seeds(paper[source], 0.01)
                    for key, source in (("acc_off", "acc_off"), ("acc_on", "acc_on"), ("loss_on", "eval_loss"))
                    if source in paper
                },
            )
        )
    findings = check_all(rows)
    assert len(findings) == 8
    assert [f.verdict for f in findings] == ["holds"] * 8, [(f.title, f.ours) for f in findings if f.verdict != "holds"]


def test_a_study_row_rerun_through_the_swarm_matches_and_is_reported(study, swarm, tmp_path):
    """A study config rerun through a swarm (hivemind DHT and libp2p on loopback; the shared one of
    the suite: `swarm lab`'s separate processes give one process's losses in tests/lab) repeats the
    single-process run; the study report puts the two side by side."""
    results = tmp_path / "runs"
    shutil.copytree(study["results"], results)
    lab_dir = tmp_path / "runs-lab"
    lab_dir.mkdir()
    cfg = load_config(study["configs"] / "b-top20.yaml")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(s, s) for s in range(cfg.model.num_stages)])
    try:
        data = build_data(cfg)
        rerun = ResultsWriter(lab_dir / "b-top20.jsonl")
        try:
            train(cfg, swarm.pipeline(cfg, run_id, None, data), data, rerun, None, progress=False)
        finally:
            rerun.close()
    finally:
        swarm.unhost(run_id)
    c = compare(load_run(results / "b-top20.jsonl"), load_run(lab_dir / "b-top20.jsonl"))
    assert c.steps == 12 and c.max_loss_rel <= 1e-5
    assert c.bytes_single == c.bytes_swarm and c.bytes_swarm
    assert len(c.evals) >= 3  # every evaluation of the swarm gives the single process's accuracies
    for _, single, swarm_evals in c.evals:
        for mode in ("uncompressed", "compressed"):
            assert swarm_evals[mode]["accuracy"] == single[mode]["accuracy"], (mode, single, swarm_evals)
    write_study_report(study["configs"], results, tmp_path / "out")
    readme = (tmp_path / "out" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| b-top20 |"))
    assert "| 12 |" in row and "| yes |" in row


def test_a_rerun_of_another_config_is_refused(study):
    with pytest.raises(ValueError, match="not a re-run of .* configs differ in compression"):
        compare(load_run(study["results"] / "a-base.jsonl"), load_run(study["results"] / "b-top20.jsonl"))


def test_runs_logged_before_a_config_field_was_added_are_not_stale(study):
    cfg = load_config(study["configs"] / "a-base.yaml")
    logged = next(r for r in read_results(study["results"] / "a-base.jsonl") if r["type"] == "config")["config"]
    older = {
        **logged,
        "compression": {k: v for k, v in logged["compression"].items() if k != "adaptive"},
    }  # as logged before `adaptive` existed
    assert same_config(logged, cfg) and same_config(older, cfg)
    assert not same_config({**logged, "seed": 1}, cfg)
    assert not same_config({**logged, "gone": 1}, cfg) and not same_config(None, cfg)
