"""Wire a config into stage runtimes and link ends: model split, optimizers, schedules, codecs."""

from __future__ import annotations

import hashlib
import json

import torch

from swarm.config import ExperimentConfig
from swarm.config.schedule import DelayCorrection
from swarm.engine.delay import StageDelay
from swarm.engine.linkend import LinkEnd, LinkEnds
from swarm.engine.optim import make_optimizer, make_scheduler
from swarm.engine.precision import Forward
from swarm.engine.stage import StageRuntime
from swarm.engine.stageparts import Objective, TrainedModule
from swarm.engine.versions import StepVersions
from swarm.models import StagedModel, build_model
from swarm.models.matrices import hidden_matrices


def build_staged_model(cfg: ExperimentConfig) -> StagedModel:
    torch.manual_seed(cfg.seed)  # the same weights whatever the transport or the number of processes
    staged = build_model(cfg.model.name, cfg.model.num_stages, **cfg.model.options)
    if len(staged.stages) != cfg.model.num_stages:
        raise ValueError(
            f"model {cfg.model.name} built {len(staged.stages)} stages, config asks for {cfg.model.num_stages}"
        )
    return staged


def link_end(
    cfg: ExperimentConfig, boundary: int, upstream: bool, capacity: int | None = None, store_dir: str | None = None
) -> LinkEnd:
    """One stage's half of `boundary` with the config's codecs; `upstream`: the half that sends
    activations. AQ-SGD rows go under `store_dir` (default: the config's store_dir)."""
    comp = cfg.compression
    link = comp.link(boundary)
    store = store_dir if store_dir is not None else comp.store_dir
    return LinkEnd(boundary, upstream, link.forward, link.backward, store, comp.store_capacity or capacity)


def link_ends(cfg: ExperimentConfig, index: int, capacity: int | None = None) -> LinkEnds:
    """The inbound (boundary index-1) and outbound (boundary index) halves of stage `index`."""
    inbound = link_end(cfg, index - 1, False, capacity) if index > 0 else None
    outbound = link_end(cfg, index, True, capacity) if index < cfg.model.num_stages - 1 else None
    return LinkEnds(inbound, outbound)


def device_problem(device: str) -> str | None:
    """Why this machine cannot compute on `device`, in one line, or None: checked when a process
    starts, so a peer without the device fails at once instead of at its run's setup."""
    try:
        index = torch.device(device).index
    except RuntimeError:
        return f"device {device!r}: not a device torch knows (cpu, cuda, cuda:N or mps)"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"device {device}: this machine has no CUDA device torch can use (torch {torch.__version__})"
        if index is not None and index >= (count := torch.cuda.device_count()):
            return f"device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    elif device == "mps" and not torch.backends.mps.is_available():
        return "device mps: not available here (it needs Apple silicon and a torch built with MPS)"
    return None


def build_runtime(
    cfg: ExperimentConfig, staged: StagedModel, index: int, total_steps: int, hold_grads: bool = False
) -> StageRuntime:
    device = torch.device(cfg.device)
    module = staged.stages[index].to(device)
    optimizer = make_optimizer(cfg.optimizer, module, hidden_matrices(staged, index))
    scheduler = make_scheduler(cfg.optimizer, optimizer, total_steps)
    last = index == cfg.model.num_stages - 1
    runtime = StageRuntime(
        index,
        cfg.model.num_stages,
        TrainedModule(module, optimizer, scheduler),
        Objective(staged.loss, staged.metrics) if last else None,
        device,
        hold_grads,
        Forward(cfg.train.precision, cfg.train.checkpoint_activations, device, cfg.seed),
    )
    runtime.targets = staged.targets  # every stage checks them: each hands them on toward the loss
    if cfg.train.schedule == "async":
        runtime.delay = StageDelay(DelayCorrection.parse(cfg.train.delay_correction))
        if hold_grads:  # a swarm's stage: two steps open at once (swarm.engine.versions)
            runtime.versions = StepVersions(runtime.delay)
    return runtime


def config_digest(cfg: ExperimentConfig) -> str:
    """What a stage's computation depends on (seed, model, optimizer, compression, precision, an
    asynchronous schedule): the trainer and every stage peer must agree on it. Where a peer keeps
    its AQ-SGD rows is its own business."""
    data = cfg.model_dump(
        mode="json",
        include={
            "seed": True,
            "model": True,
            "optimizer": True,
            "compression": True,
            "train": {"precision", "checkpoint_activations"},
        },
        exclude={"compression": {"store_dir"}},
    )
    if (
        cfg.train.schedule != "sync"
    ):  # a stage applies a step late (swarm.engine.delay); sync runs' digests as they were
        data["schedule"] = [cfg.train.schedule, cfg.train.delay_correction]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
