"""What each rank of the gloo baseline runs, once the process group is up."""

from __future__ import annotations

from swarm.bench.gloo.mailbox import Mailbox
from swarm.bench.gloo.stage import StageRank, neighbours, rank_of
from swarm.bench.gloo.trainer import GlooPipeline
from swarm.config import ExperimentConfig


def train_rank(
    cfg: ExperimentConfig, stages: int, delay_s: float, results_path: str | None, max_steps: int | None
) -> int:
    """Rank 0: tells every stage the schedule's length, trains, stops the stages."""
    from swarm.engine.build import build_staged_model
    from swarm.training.experiment import build_data, open_results
    from swarm.training.loop import Schedule, train
    from swarm.training.progress import RunProgress, echo_lines

    data = build_data(cfg)
    schedule = Schedule.of(cfg, len(data[0]), max_steps)
    mailbox = Mailbox([rank_of(s) for s in range(stages)], delay_s)
    tied = build_staged_model(cfg).tied  # which parameters two stages share (the weights are the stages')
    pipeline = GlooPipeline(mailbox, stages, cfg.train.in_flight or 2 * stages, tied, cfg.optimizer.grad_clip)
    for stage in range(stages):
        mailbox.send(rank_of(stage), ("setup", schedule.lr_horizon))
    results = open_results(results_path)
    progress = RunProgress(schedule.total_steps)
    results.listeners += [progress.observe, echo_lines(progress, lambda text: print(text, flush=True))]
    try:
        summary = train(cfg, pipeline, data, results, max_steps, progress=False)
    finally:
        results.close()
    pipeline.stop()
    mailbox.flush()
    print(f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f}s", flush=True)
    return 0


def stage_rank(cfg: ExperimentConfig, stage: int, stages: int, delay_s: float) -> int:
    """Rank stage + 1: waits for the schedule's length, then serves until the trainer stops it."""
    mailbox = Mailbox(neighbours(stage, stages), delay_s)
    _, message = mailbox.receive()
    if message[0] != "setup":
        raise RuntimeError(f"stage {stage}: expected the trainer's setup, got {message[0]!r}")
    StageRank(cfg, stage, mailbox, message[1]).serve()
    return 0
