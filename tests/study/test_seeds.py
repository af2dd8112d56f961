"""Seeds in a study: naming and resumption, the order runs go in, progress, stamps, the report's
mean ± std, its refusal to mix commits, and plots with bands."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest
from _study_configs import write_tiny_configs
from _util import refusal

from swarm.cli import main
from swarm.study.entries import Entry, Status, discover, status
from swarm.study.order import plan
from swarm.study.plots import across_seeds, plot_table
from swarm.study.progress import estimate, heartbeat_line
from swarm.study.report import study_runs, write_study_report
from swarm.study.runner import StudyOutput, run_study
from swarm.study.stamps import MixedCommits
from swarm.training.results import read_results

ROWS = [("a-base", "none", "none"), ("b-top20", "topk:0.2", "topk:0.2"), ("c-top10", "topk:0.1", "topk:0.1")]


def write_configs(directory: Path, rows=ROWS) -> Path:
    return write_tiny_configs(directory, rows, epochs=2)


def run_rows(configs: Path, results: Path, only: str, seeds: int) -> str:
    """The study's log of running one config at `seeds` seeds."""
    log = io.StringIO()
    done = run_study(
        configs, results, [only], output=StudyOutput(heartbeat=0, progress=False, out=log), seeds=seeds, every_row=True
    )
    assert done == 0, log.getvalue()
    return log.getvalue()


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """a-base at seeds 0 and 1, b-top20 at seed 0: three short runs; then a-base asked for again."""
    configs = write_configs(tmp_path_factory.mktemp("seeds") / "configs")
    results = configs.parent / "runs"
    run_rows(configs, results, "a-base", 2)
    run_rows(configs, results, "b-top20", 1)
    return {"configs": configs, "results": results, "again": run_rows(configs, results, "a-base", 2)}


def config_row(path: Path) -> dict:
    return next(r for r in read_results(path) if r["type"] == "config")


def test_seed_runs_are_named_by_seed_resumable_and_stamped(seeded):
    results = seeded["results"]
    assert sorted(p.name for p in results.glob("*.jsonl")) == ["a-base.jsonl", "a-base.seed1.jsonl", "b-top20.jsonl"]
    assert config_row(results / "a-base.jsonl")["config"]["seed"] == 0
    assert config_row(results / "a-base.seed1.jsonl")["config"]["seed"] == 1
    losses = [
        [r["loss"] for r in read_results(results / f) if r["type"] == "step"]
        for f in ("a-base.jsonl", "a-base.seed1.jsonl")
    ]
    assert losses[0] != losses[1]  # another seed trains another model
    assert "2 runs, 2 finished, 0 to run" in seeded["again"]  # nothing runs twice
    stamp = config_row(results / "a-base.seed1.jsonl")["stamp"]
    assert set(stamp) == {"commit", "torch", "threads"} and stamp["commit"] and stamp["threads"] >= 1
    # the report finds every seed that has a file; seed 2 was never run
    names = sorted(r["path"].rsplit("/", 1)[-1] for r in study_runs(seeded["configs"], results) if r["path"])
    assert names == ["a-base.jsonl", "a-base.seed1.jsonl", "b-top20.jsonl"]


def test_runs_settling_the_findings_go_first_round_robin_over_seeds(tmp_path):
    study = Path(__file__).resolve().parents[2] / "configs" / "study-cpu"
    order = [e.name for e in plan(discover(study, tmp_path / "runs", seeds=3))]
    # 28 rows the findings compare at 3 seeds, then fw4-bw8 (no finding compares it) once
    assert len(order) == 28 * 3 + 1 and order[-1] == "table1-r1-fw4-bw8"
    assert order[:2] == ["table1-r0-baseline", "table5-r0-gpt2-baseline"]  # baselines first
    first_round = order[:28]
    assert not any(".seed" in name for name in first_round)
    assert order[28:56] == [f"{name}.seed1" for name in first_round]  # round-robin over seeds
    assert order[56:84] == [f"{name}.seed2" for name in first_round]
    assert "table1-r1-fw4-bw8" not in first_round
    every = [e.name for e in plan(discover(study, tmp_path / "runs", seeds=2), every_row=True)]
    assert every[-2:] == ["table1-r1-fw4-bw8", "table1-r1-fw4-bw8.seed1"]
    with pytest.raises(ValueError, match="--seeds must be at least 1"):
        discover(study, tmp_path / "runs", seeds=0)


def test_time_left_comes_from_finished_runs_of_the_same_row_or_model(tmp_path):
    configs = write_configs(tmp_path / "configs")
    entries = discover(configs, tmp_path / "runs", seeds=2)  # a, a.seed1, b, b.seed1, c, c.seed1
    states = {e.name: Status("pending") for e in entries}
    # a-base was paused for an hour: its pace is its computing time
    states["a-base"] = Status("finished", 8, 2.0, wall_time_s=3700.0, computing_s=100.0)
    states["a-base.seed1"] = Status("partial", 4, 1.5)  # 3/4 of its 2 epochs behind it: 25 s left
    states["b-top20"] = Status("finished", 8, 2.0, wall_time_s=300.0, computing_s=300.0)
    got = estimate(entries, states)
    # b.seed1 at b's pace (300); c and c.seed1 at the model's (mean of 100 and 300)
    assert (got.done, got.left, got.untimed) == (2, 4, 0)
    assert got.seconds == pytest.approx(25 + 300 + 2 * 200)
    assert got.line() == "2 done / 4 left, about 12m05s left"
    steps = [{"type": "step", "step": s, "epoch": s / 4, "loss": 1.0, "time_s": 7.5 * s} for s in (1, 2, 3, 4)]
    steps[2]["time_s"] += 3600.0  # paused for an hour before its third step
    steps[3]["time_s"] += 3600.0
    line = heartbeat_line(entries[1], steps, 30.0, got)
    # this run: 30 s of computing for half of it, 30 s to go; with the others 725 s + 30 s
    assert line.endswith("study: 2 done / 5 left, about 12m35s left")


def test_status_says_runs_done_left_and_time_left(seeded, capsys):
    args = [
        "study",
        str(seeded["configs"]),
        "--results_dir",
        str(seeded["results"]),
        "--seeds",
        "2",
        "--every_row",
        "--status",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("finished  a-base ") and out[1].startswith("finished  b-top20 ")
    assert out[-1].startswith("6 runs: 3 finished, 3 pending;") and "3 done / 3 left, about " in out[-1]


def test_report_shows_mean_and_std_and_marks_single_seeds(seeded, tmp_path):
    write_study_report(seeded["configs"], seeded["results"], tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    accs = [
        100
        * next(r for r in read_results(seeded["results"] / f) if r["type"] == "summary")["best"]["compressed"][
            "accuracy"
        ]
        for f in ("a-base.jsonl", "a-base.seed1.jsonl")
    ]
    base = [c.strip() for c in next(line for line in md.splitlines() if line.startswith("| a-base |")).split("|")]
    assert f"{statistics.fmean(accs):.2f} ± {statistics.stdev(accs):.2f}" in base and "2" in base
    top20 = next(line for line in md.splitlines() if line.startswith("| b-top20 |"))
    assert "†" in top20 and "† one seed: no spread, illustrative only" in md
    assert "unstamped" not in md and "run(s) of commit " in md
    assert (tmp_path / "out" / "table-2-topk.png").stat().st_size > 1000


def restamp(path: Path, stamp: dict | None) -> None:
    rows = read_results(path)
    for row in rows:
        if row["type"] == "config":
            row.pop("stamp", None)
            if stamp is not None:
                row["stamp"] = stamp
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_refuses_to_mix_commits_unless_told(seeded, tmp_path, capsys):
    results = tmp_path / "runs"
    results.mkdir()
    for path in seeded["results"].glob("*.jsonl"):
        (results / path.name).write_text(path.read_text())
    restamp(results / "a-base.seed1.jsonl", {"commit": "abc123", "torch": "2.0", "threads": 1})
    with pytest.raises(MixedCommits, match=r"Table 2: TopK: results of 2 commits \(.*abc123.*\) in one table"):
        write_study_report(seeded["configs"], results, tmp_path / "out")
    args = ["report", "--study", str(seeded["configs"]), "--results_dir", str(results), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mix_commits" in err
    assert main([*args, "--mix_commits"]) == 0
    md = (tmp_path / "out" / "results.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| row |"))
    assert header.rstrip(" |").endswith("commit")
    assert "abc123" in next(line for line in md.splitlines() if line.startswith("| a-base |"))
    # results from before stamps: one group, "unstamped", reported without complaint
    for path in results.glob("*.jsonl"):
        restamp(path, None)
    write_study_report(seeded["configs"], results, tmp_path / "old")
    old = (tmp_path / "old" / "results.md").read_text()
    assert "3 run(s) unstamped (written before results recorded their commit, torch and threads)" in old


def test_plots_draw_each_row_as_mean_with_a_band(seeded, tmp_path):
    xs, mean, low, high = across_seeds([{1: 1.0, 2: 4.0, 3: 5.0}, {1: 3.0, 2: 2.0}])
    assert (xs, mean, low, high) == ([1, 2], [2.0, 3.0], [1.0, 2.0], [3.0, 4.0])
    runs = [r for r in study_runs(seeded["configs"], seeded["results"]) if r["name"] == "a-base"]
    assert len(runs) == 2
    png = plot_table("Two seeds", [runs], tmp_path)
    assert png.name == "two-seeds.png" and png.stat().st_size > 1000


def test_entries_name_seeds_after_the_seed_they_train_with(tmp_path):
    configs = write_configs(tmp_path / "configs", ROWS[:1])
    path = configs / "a-base.yaml"
    path.write_text(path.read_text().replace("seed: 0", "seed: 5"))
    entries = discover(configs, tmp_path / "runs", seeds=2)
    assert [(e.name, e.cfg.seed, e.row) for e in entries] == [("a-base", 5, "a-base"), ("a-base.seed6", 6, "a-base")]
    assert isinstance(entries[1], Entry) and status(entries[1]).state == "pending"


def test_a_language_models_table_is_told_by_its_perplexity_not_its_dataset_name():
    from swarm.study.runs import language

    def run(data: str, evals: list[dict]) -> dict:
        return {"config": {"data": {"name": data}}, "evals": evals}

    bytes_lm = [{"uncompressed": {"loss": 2.6, "perplexity": 13.5, "accuracy": 0.3}}]
    images = [{"uncompressed": {"loss": 1.2, "accuracy": 0.48}}]
    assert language(run("text", bytes_lm))  # a byte-level model on plain text (configs/rank-sweep)
    assert language(run("wikitext2", bytes_lm))
    assert not language(run("cifar10", images))
    assert language(run("text", [])) and not language(run("cifar10", []))  # not evaluated yet: by its data


def test_report_refuses_results_files_whose_config_line_is_no_run_s_in_one_line(tmp_path, capsys):
    cases = {
        '{"type": "config"}': "its config line has no run name or no config",
        '{"type": "config", "name": "x", "config": 5}': "its config line has no run name or no config",
        '{"type": "config", "name": "x", "config": {"a": 1}}': "a results file's config does not read as a run's",
    }
    for text, message in cases.items():
        (tmp_path / "r.jsonl").write_text(text + "\n")
        assert message in refusal(capsys, "report", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "out"))


def test_a_study_report_refuses_a_results_dir_that_is_not_there(seeded, tmp_path, capsys):
    args = [
        "report",
        "--study",
        str(seeded["configs"]),
        "--results_dir",
        str(tmp_path / "runz"),
        "--out",
        str(tmp_path),
    ]
    line = refusal(capsys, *args)  # a typo would otherwise report every row pending
    assert line == f"error: --results_dir {tmp_path / 'runz'} is not a directory (where `swarm study` wrote the runs)"
