"""The stages of a run rebuilt as the run built them (the same seed: the same frozen weights of a
LoRA run), with a run's saved state loaded into them."""

from __future__ import annotations

import torch

from swarm.engine.build import build_staged_model
from swarm.engine.checkpoint import check_module_state
from swarm.export.state import RunState
from swarm.models import StagedModel


def rebuild(run: RunState) -> StagedModel:
    """The run's stages in evaluation mode, holding `run`'s weights; ValueError in one line when a
    state does not fit its stage, or when the copies of a tied parameter differ (the stages would
    not be one model: the export would change the logits)."""
    staged = build_staged_model(run.cfg)  # on the CPU, whatever the run's device
    for index, (stage, state) in enumerate(zip(staged.stages, run.stages, strict=True)):
        check_module_state(stage, state["module"], f"{run.source}: stage {index}'s state")
        stage.load_state_dict(state["module"], strict=False)  # frozen parameters are the rebuilt ones
    for pair in staged.tied:
        first = staged.stages[pair.first[0]].get_parameter(pair.first[1])
        second = staged.stages[pair.second[0]].get_parameter(pair.second[1])
        if not torch.equal(first, second):
            difference = float((first - second).abs().max())
            raise ValueError(
                f"{run.source}: the copies of tied parameter {pair.first[1]} (stage {pair.first[0]}) and"
                f" {pair.second[1]} (stage {pair.second[0]}) differ by up to {difference:.3g}"
            )
    return staged.eval()
