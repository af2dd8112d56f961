"""A swarm stage's state under `train.schedule: async`, in process (no network): drained after a
step it holds that step's gradients unapplied, and writes them as one process's kept gradients
(StageState.saved); installing a stage file holds them again for that step's decision
(StageState.restored)."""

from __future__ import annotations

import pytest
import torch
from _util import SMOKE

from protocols.errors import RemoteError
from swarm.config import load_config
from swarm.data import collate
from swarm.engine.checkpoint import apply_stage_state
from swarm.engine.linkend import LinkEnds
from swarm.engine.microbatch import Mode
from swarm.engine.stage import step_keys
from swarm.training.experiment import build_data
from swarm.training.loop import split_micro_batches
from swarm.transport.hivemind.stage.state import StagePlace, StageState
from swarm.transport.local import build_local_pipeline

NO_ENDS = LinkEnds(None, None)


def _cfg():
    return load_config(SMOKE, ["model.num_stages=3", "optimizer.grad_clip=0.5", "train.schedule=async"])


def _step_zero(cfg):
    ids, inputs, targets = collate([build_data(cfg)[0][i] for i in range(cfg.train.batch_size)])
    return split_micro_batches(0, ids, inputs, targets, cfg.train.micro_batches, Mode.TRAIN, False)


def _states(cfg, pipeline) -> list[StageState]:
    states = []
    for runtime in pipeline.runtimes:
        runtime.hold_grads = True  # as a swarm's stage: each micro-batch's gradients apart
        state = StageState(StagePlace(None, "run", runtime.index, cfg.model.num_stages, ""), cfg)
        state.runtime = runtime
        states.append(state)
    return states


def test_a_drained_stage_writes_and_reads_one_process_s_kept_gradients():
    cfg = _cfg()
    swarm_side = build_local_pipeline(cfg, 100)[0]
    states = _states(cfg, swarm_side)
    swarm_side.run_many(_step_zero(cfg))  # step 0 ran; its decision is pending (applied with step 2's)
    one_process = build_local_pipeline(cfg, 100)[0]
    one_process.run_many(_step_zero(cfg))
    one_process.step()  # the first step applies nothing and keeps step 0's gradients
    for state, runtime in zip(states, one_process.runtimes, strict=True):
        saved = state.saved(NO_ENDS, 1)
        kept, theirs = saved["delay"]["kept"], runtime.delay.kept
        assert list(kept) == list(theirs) and all(torch.equal(kept[n], theirs[n]) for n in theirs)
        assert saved["delay"]["then"] is None and saved["step"] == 1
        assert state.saved(NO_ENDS, 0)["delay"]["kept"] is None  # before any step: nothing kept
        with pytest.raises(RemoteError, match=r"has applied 0 step\(s\): it holds no state of step 3"):
            state.saved(NO_ENDS, 3)

        # installed again (a checkpoint or copy of step 1): held as step 0's, its decision pending
        fresh = build_local_pipeline(cfg, 100)[0].runtimes[state.place.stage]
        fresh.hold_grads = True
        restored = StageState(state.place, cfg)
        restored.runtime = fresh
        assert apply_stage_state(fresh, NO_ENDS, saved) == 1
        restored.restored(cfg, 1)
        keys = step_keys(0, cfg.train.micro_batches)
        assert restored.steps == 0 and restored.counted == [(restored.generation, 0)]
        assert fresh.delay.kept is None and set(fresh.held) == set(keys)
        assert fresh.held_sq_norm(keys) == state.runtime.held_sq_norm(keys)
        assert restored.saved(NO_ENDS, 1)["delay"]["kept"].keys() == kept.keys()  # and written back the same


def test_a_synchronous_stage_writes_no_kept_gradients():
    cfg = load_config(SMOKE, ["model.num_stages=3"])
    pipeline = build_local_pipeline(cfg, 100)[0]
    [state, *_] = _states(cfg, pipeline)
    state.steps = 2
    assert state.drained(2) == 2 and state.saved(NO_ENDS, 2)["delay"] is None
