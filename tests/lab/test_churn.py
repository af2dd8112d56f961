"""`swarm lab --churn`: its SPEC, and one lab run whose stage peers join, die (kill -9) and leave
(SIGTERM) while it trains, which then loses a stage's last peer and its trainer (kill -9, the
trainer started again), ending with the single-process run's losses."""

from __future__ import annotations

import re
import sys

import pytest
from _swarm_env import assert_losses_of_one_process, one_process_meanwhile, run_tagged
from _util import REPO, SMOKE

from swarm.lab.churn import JOIN_WAIT_S, Churn, ChurnError, ChurnEvent, ChurnRunner
from swarm.lab.plan import RunOptions, RunPlan


def test_a_schedule_parses_in_time_order_and_bad_specs_are_one_line():
    churn = Churn.parse("kill:1@20, join:1@0,stop:2@7.5s,join:2@step30", stages=3)
    at_step = ChurnEvent(float("inf"), "join", 2, 30)
    assert churn.events == [ChurnEvent(0, "join", 1), ChurnEvent(7.5, "stop", 2), ChurnEvent(20, "kill", 1), at_step]
    assert Churn.parse("kill:trainer@step12,kill:trainer@30", stages=2).events == [
        ChurnEvent(30, "kill", "trainer"),
        ChurnEvent(float("inf"), "kill", "trainer", 12),
    ]
    assert churn.due(8, {0: 1, 1: 1, 2: 1}, step=29) == [ChurnEvent(0, "join", 1), ChurnEvent(7.5, "stop", 2)]
    assert churn.due(8, {}, step=30) == [at_step] and churn.due(20, {}) == [ChurnEvent(20, "kill", 1)]
    for spec, message in [
        ("explode:1@3", "is not ACTION:STAGE@SECONDS"),
        ("kill:1@step", "is not ACTION:STAGE@SECONDS"),
        ("kill:5@3", "names stage 5, the run has stages 0..2"),
        ("join:1", "is not ACTION:STAGE@SECONDS"),
        ("random:3@0", "the interval must be positive"),
        ("join:trainer@3", "the trainer can only be killed"),
        ("stop:trainer@step5", "the trainer can only be killed"),
        ("kill:trainers@3", "is not ACTION:STAGE@SECONDS"),
        (",", "no events given"),
        ("random:1,random:2", "one random:SEED item at most"),
    ]:
        with pytest.raises(ChurnError, match=message) as caught:
            Churn.parse(spec, stages=3)
        assert "\n" not in str(caught.value)


def test_random_churn_is_seeded_and_never_takes_a_stages_last_peer():
    def draw(seed: int) -> list[ChurnEvent]:
        churn = Churn.parse(f"random:{seed}@10", stages=3)
        live = {0: 1, 1: 1, 2: 1}
        events = churn.due(1000, live)
        return events, live

    events, live = draw(7)
    assert events == draw(7)[0] and events != draw(8)[0]
    assert 60 <= len(events) <= 200  # one about every 10 s
    assert all(n >= 1 for n in live.values())
    counts = {0: 1, 1: 1, 2: 1}
    for event in events:
        counts[event.stage] += 1 if event.action == "join" else -1
        assert counts[event.stage] >= 1
    assert {e.action for e in events} == {"join", "kill", "stop"}


def test_a_schedule_and_random_churn_happen_together_and_the_draws_see_the_schedule():
    churn = Churn.parse("random:7@10,join:1@0,kill:trainer@step40", stages=3)
    assert churn.seed == 7 and churn.joiners() is None  # random joiners are named as they start
    live = {0: 1, 1: 1, 2: 1}
    first = churn.due(0, live)
    assert first == [ChurnEvent(0, "join", 1)] and live == {0: 1, 1: 2, 2: 1}
    later = churn.due(1000, live, step=40)
    assert ChurnEvent(float("inf"), "kill", "trainer", 40) in later
    drawn = [e for e in later if e.stage != "trainer"]
    assert drawn == Churn.parse("random:7@10", stages=3).due(1000, {0: 1, 1: 2, 2: 1})  # the same draws
    counts = {0: 1, 1: 2, 2: 1}
    for event in drawn:
        counts[event.stage] += 1 if event.action == "join" else -1
        assert counts[event.stage] >= 1
    assert counts == live


class _Peer:
    """A stand-in for a peer's process as the runner sees it: alive until signalled."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def poll(self):
        return None if not self.signals else -9


class _Lab:
    """What a ChurnRunner reads and calls of a Lab (no processes: its waiting is what is tested)."""

    def __init__(self) -> None:
        self.run_plan = RunPlan.of(str(SMOKE), 2, RunOptions())
        self.trainer = type("Trainer", (), {"ready": type("Ready", (), {"is_set": lambda self: True})()})()
        self.processes, self.joined_peers, self.lines = [("stage1", _Peer())], set(), []
        self.output = type("Out", (), {"say": lambda _, name, line: self.lines.append(line)})()

    def _start(self, name: str, *args: str) -> _Peer:
        self.processes.append((name, _Peer()))
        return self.processes[-1][1]

    def signal_peer(self, process: _Peer, signum: int) -> None:
        process.signals.append(signum)


def test_a_kill_waits_for_a_joiner_of_its_stage_to_have_its_state():
    lab = _Lab()
    runner = ChurnRunner(lab, Churn.parse("join:1@0,kill:1@step3", stages=2), [])
    runner.poll(0.0, 0)
    runner.poll(1.0, 3)  # due, but stage1.2 is still joining: the kill waits
    first = dict(lab.processes)["stage1"]
    assert first.signals == [] and lab.lines[-1] == "churn at 1.0s: kill stage 1 waits for stage1.2 to join"
    runner.poll(2.0, 4)
    assert first.signals == []
    lab.joined_peers.add("stage1.2")
    runner.poll(3.0, 5)
    assert first.signals == [9] and lab.lines[-1] == "churn at 3.0s: kill stage1"
    # a joiner that never gets there holds a stop at most JOIN_WAIT_S
    runner = ChurnRunner(lab := _Lab(), Churn.parse("join:1@0,stop:1@1", stages=2), [])
    runner.poll(0.0, 0)
    runner.poll(1.0, 0)
    runner.poll(JOIN_WAIT_S, 0)
    assert dict(lab.processes)["stage1"].signals == []
    runner.poll(1.0 + JOIN_WAIT_S, 0)
    assert dict(lab.processes)["stage1"].signals == [15]


@pytest.mark.peers
def test_lab_with_peers_joining_dying_and_leaving_and_a_lost_stage_and_trainer_keeps_the_single_process_losses(
    tmp_path,
):
    """One lab run with every kind of churn. Stages 1 and 2 each get a second peer (started without
    --config, as a volunteer would) once training runs; later stage 1's first peer is killed -9 and
    stage 2's first stopped with SIGTERM. Then stage 0's only peer is killed -9 and a new one
    started: the trainer pauses until it announces itself, every stage goes back to the newest
    copies and the loop replays. Then the trainer is killed -9 and the lab starts it again with the
    same command: it finds the copies, keeps its results file's rows up to there and goes on.
    Copies every 5 steps; codecs without state across micro-batches (smoke: topk 20% forward, its
    indices backward), so a replayed step computes what the first did. A 20 ms delay per message
    keeps a step at about 0.3 s, so the joiners start, on cores the run shares with them, well
    before the kills, and the trainer dies between two snapshot rounds (on a busy machine an event
    may land a step or more late: the copies are then a round newer)."""
    results = tmp_path / "churn.jsonl"
    overrides = ["train.epochs=100", "train.eval_every=1000"]
    sets = [a for o in overrides for a in ("--set", o)]
    # the joiners join at step 13-14 with the load average at 18 (their processes forked from the
    # lab's spawner: swarm.lab.spawn), and a kill or stop waits for its stage's joiner anyway; the
    # stopped peer's process ends about 12 steps after its SIGTERM
    steps = 70
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "3", "--steps", str(steps), *sets]
    command += ["--delay", "20ms", "--shaping", "inprocess", "--no_probe", "--results", str(results)]
    command += ["--snapshot_every", "5", "--churn"]
    command += ["join:1@0,join:2@0,kill:1@step28,stop:2@step30,kill:0@step42,join:0@step42,kill:trainer@step56"]
    reference = one_process_meanwhile(SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps)
    finished = run_tagged(command, timeout=500, cwd=REPO)
    out, daemons_left = finished.done, finished.daemons_left
    log = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    for line in ("join stage1.2", "join stage2.2", "kill stage1\n", "stop stage2\n", "[stage2] left the run"):
        assert line in out.stdout, log
    for stage in (1, 2):
        assert re.search(rf"\[trainer\] .* stage {stage}: peer \w+ joins at step \d+", out.stdout)
        assert re.search(rf"\[stage{stage}\.2\] .* joined with the state of step \d+", out.stdout)
        served = re.findall(rf"\[stage{stage}\.2\] stage {stage}: (\d+) micro-batches", out.stdout)
        assert served and int(served[-1]) > 0, log  # the joiners took work
    # the trainer heard the stopped peer's goodbye (whether any micro-batch reached it while it
    # drained, and was refused, depends on when the routers looked at its record)
    about_stage2 = "\n".join(line for line in out.stdout.splitlines() if "stage 2" in line or "[stage2]" in line)
    assert "it drained and leaves after this step" in out.stdout, about_stage2[-6000:]
    for line in (
        r"\[lab\] churn at [\d.]+s: kill stage0\n",
        r"\[lab\] churn at [\d.]+s: kill trainer\n",
        r"\[lab\] churn: trainer started again\n",
        r"\[trainer\] .* run '[\w-]+' paused at step 4\d: stage 0 has no peer; start one to go on",
        r"\[trainer\] .* run resumed after [\d.]+s: every stage went back to step [45][05], replaying \d+ step",
        r"\[trainer\] .* the swarm kept copies of every stage at step 5[05]; resuming there",  # the new trainer
    ):
        assert re.search(line, out.stdout), (line, log)
    assert_losses_of_one_process(
        results, SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps, reference=reference
    )
    assert daemons_left == 0


@pytest.mark.peers
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_lab_with_two_then_three_replicas_a_kill_and_a_joiner_keeps_one_process_bit_for_bit(tmp_path, schedule):
    """Stage 1 gets a second and a third peer once training runs, and stage 2 a second; then stage
    1's first peer is killed -9. The replicas split the steps' micro-batches however their routes
    fall, and sum them exactly (swarm.engine.exactsum): every loss and evaluation is one process's,
    bit for bit, under either schedule."""
    results = tmp_path / "replicas.jsonl"
    overrides = ["train.epochs=100", "train.eval_every=20", f"train.schedule={schedule}"]
    sets = [a for o in overrides for a in ("--set", o)]
    # the joiners fork from the lab's spawner and join within about 15 steps under load (the churn
    # test above), and the kill waits for its stage's joiners (an event)
    steps = 50
    # the asynchronous schedule keeps the pipeline full: a longer delay keeps its steps as long as
    # the synchronous ones, so the joiners' processes start well before the kill
    delay = "20ms" if schedule == "sync" else "80ms"
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "3", "--steps", str(steps), *sets]
    command += ["--delay", delay, "--shaping", "inprocess", "--no_probe", "--results", str(results)]
    command += ["--churn", "join:1@0,join:1@0,join:2@0,kill:1@step30"]
    reference = one_process_meanwhile(SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps)
    finished = run_tagged(command, timeout=500, cwd=REPO)
    out, daemons_left = finished.done, finished.daemons_left
    log = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    assert "kill stage1\n" in out.stdout, log
    served = [re.findall(rf"\[stage1\.{n}\] stage 1: (\d+) micro-batches", out.stdout) for n in (2, 3)]
    assert all(counts and int(counts[-1]) > 0 for counts in served), log  # both joiners took work
    assert_losses_of_one_process(
        results, SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps, reference=reference
    )
    assert daemons_left == 0
