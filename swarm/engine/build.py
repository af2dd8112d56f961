"""Wire a config into stage runtimes: model split, optimizers, schedules and link ends."""

from __future__ import annotations

import torch

from swarm.config import ExperimentConfig
from swarm.engine.linkend import LinkEnd
from swarm.engine.optim import make_optimizer, make_scheduler
from swarm.engine.stage import StageRuntime


def build_staged_model(cfg: ExperimentConfig):
    from swarm.models import build_model

    torch.manual_seed(cfg.seed)  # the same weights whatever the transport or the number of processes
    return build_model(cfg.model.name, cfg.model.num_stages, **cfg.model.options)


def link_ends(cfg: ExperimentConfig, index: int, capacity: int | None = None) -> tuple[LinkEnd | None, LinkEnd | None]:
    """The inbound (boundary index-1) and outbound (boundary index) halves of stage `index`."""
    comp = cfg.compression
    capacity = comp.store_capacity or capacity
    inbound = outbound = None
    if index > 0:
        link = comp.link(index - 1)
        inbound = LinkEnd(index - 1, False, link.forward, link.backward, comp.store_dir, capacity)
    if index < cfg.model.num_stages - 1:
        link = comp.link(index)
        outbound = LinkEnd(index, True, link.forward, link.backward, comp.store_dir, capacity)
    return inbound, outbound


def build_runtime(
    cfg: ExperimentConfig, staged, index: int, total_steps: int, capacity: int | None = None, hold_grads: bool = False
) -> StageRuntime:
    device = torch.device(cfg.device)
    module = staged.stages[index].to(device)
    optimizer = make_optimizer(cfg.optimizer, module)
    scheduler = make_scheduler(cfg.optimizer, optimizer, total_steps)
    last = index == cfg.model.num_stages - 1
    inbound, outbound = link_ends(cfg, index, capacity)
    return StageRuntime(
        index,
        cfg.model.num_stages,
        module,
        optimizer,
        scheduler,
        staged.loss if last else None,
        staged.metrics if last else None,
        inbound,
        outbound,
        device,
        hold_grads,
    )


def build_local_pipeline(cfg: ExperimentConfig, total_steps: int, capacity: int | None = None):
    from swarm.transport.local import LocalPipeline

    staged = build_staged_model(cfg)
    if len(staged.stages) != cfg.model.num_stages:
        raise ValueError(
            f"model {cfg.model.name} built {len(staged.stages)} stages, config asks for {cfg.model.num_stages}"
        )
    runtimes = [build_runtime(cfg, staged, i, total_steps, capacity) for i in range(cfg.model.num_stages)]
    return LocalPipeline(runtimes, staged.tied, cfg.optimizer.grad_clip), staged
