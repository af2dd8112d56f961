"""optimizer.name: muon: which parameters Muon trains, that its steps are torch's Muon and AdamW's,
its schedule, its state's round trip, and its config's refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _util import SMOKE, one_line_error
from torch import nn

from swarm.config import OptimizerConfig, load_config
from swarm.engine.build import build_staged_model
from swarm.engine.muon import ADAMW, MUON, MuonAdamW, muon_groups
from swarm.engine.optim import make_optimizer, schedule_factor
from swarm.models.matrices import hidden_matrices

GPT2 = (
    "model={name: gpt2, num_stages: 2, options: {config: {n_layer: 2, n_embd: 32, n_head: 2, n_positions: 16,"
    " vocab_size: 64, resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0}}}"
)


def _names(module: nn.Module, ids: set[int]) -> set[str]:
    return {name for name, p in module.named_parameters() if id(p) in ids}


def test_a_decoder_trains_its_blocks_matrices_with_muon_and_the_rest_with_adamw():
    staged = build_staged_model(load_config(SMOKE, [GPT2]))
    first, last = (_names(staged.stages[i], hidden_matrices(staged, i)) for i in (0, 1))
    assert first == {f"h.0.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert last == {f"h.1.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    # embeddings, the (tied) head, norms and biases stay with AdamW
    optimizer = make_optimizer(OptimizerConfig(name="muon", lr=0.02), staged.stages[0], hidden_matrices(staged, 0))
    kinds = {kind: set() for kind in (MUON, ADAMW)}
    for group in optimizer.param_groups:
        kinds[group["kind"]] |= _names(staged.stages[0], {id(p) for p in group["params"]})
    assert {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.bias"} <= kinds[ADAMW]
    assert kinds[MUON] == first


def test_a_plain_stack_keeps_its_input_and_output_layers_off_muon():
    staged = build_staged_model(load_config(SMOKE))  # digits_cnn: convolutions, then linear layers
    chosen = [_names(stage, hidden_matrices(staged, i)) for i, stage in enumerate(staged.stages)]
    first_weight = next(n for n, p in staged.stages[0].named_parameters() if p.ndim >= 2)
    last_weight = [n for n, p in staged.stages[-1].named_parameters() if p.ndim >= 2][-1]
    assert first_weight not in chosen[0] and last_weight not in chosen[-1]
    assert all(chosen[1:-1]), "the middle stages' weights are all hidden matrices"
    assert any(
        p.ndim == 4 for i, s in enumerate(staged.stages) for p in s.parameters() if id(p) in hidden_matrices(staged, i)
    )


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 5), nn.LayerNorm(5))
    twin = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 5), nn.LayerNorm(5))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _grads(models: tuple[nn.Module, ...], seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    for m in models:
        m.zero_grad()
        m(x).square().sum().backward()


def test_its_steps_are_torch_muon_and_adamw_bit_for_bit():
    model, twin = _pair()
    cfg = OptimizerConfig(name="muon", lr=0.02, adamw_lr=0.003, weight_decay=0.01)
    ours = MuonAdamW(muon_groups(cfg, list(model.parameters()), {id(model[1].weight)}), cfg)
    muon = torch.optim.Muon([twin[1].weight], lr=0.02, weight_decay=0.01, momentum=0.95)
    rest = [p for p in twin.parameters() if p is not twin[1].weight]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=0.003,
    )
    for seed in range(4):
        _grads((model, twin), seed)
        ours.step()
        muon.step()
        adamw.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_convolution_kernel_steps_as_its_flattened_matrix():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    flat = nn.Parameter(conv.weight.detach().reshape(4, -1).clone())
    cfg = OptimizerConfig(name="muon", lr=0.05, weight_decay=0.0)
    ours = MuonAdamW(muon_groups(cfg, [conv.weight], {id(conv.weight)}), cfg)
    theirs = torch.optim.Muon([flat], lr=0.05, weight_decay=0.0, momentum=0.95)
    for seed in range(3):
        g = torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(seed))
        conv.weight.grad, flat.grad = g.clone(), g.reshape(4, -1).clone()
        ours.step()
        theirs.step()
    assert torch.equal(conv.weight.detach().reshape(4, -1), flat.detach())


def test_its_state_round_trips_and_another_split_is_refused():
    model, twin = _pair()
    cfg = OptimizerConfig(name="muon", lr=0.02)
    first = MuonAdamW(muon_groups(cfg, list(model.parameters()), {id(model[1].weight)}), cfg)
    second = MuonAdamW(muon_groups(cfg, list(twin.parameters()), {id(twin[1].weight)}), cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first, lambda s: 0.5 ** (s + 1))
    for seed in range(2):
        _grads((model,), seed)
        first.step()
        scheduler.step()
    twin.load_state_dict(model.state_dict())
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # as from a file: no tensor shared
    assert [g["lr"] for g in second.param_groups] == [g["lr"] for g in first.param_groups]
    for seed in range(2, 4):  # both continue alike: the AdamW part follows the loaded groups and state
        _grads((model, twin), seed)
        first.step()
        second.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    other = MuonAdamW(muon_groups(cfg, list(twin.parameters()), set()), cfg)
    message = one_line_error("its groups follow", other.load_state_dict, first.state_dict())
    assert "muon" in message


def test_the_schedule_scales_both_rates_and_decays_to_its_floor():
    cfg = OptimizerConfig(name="muon", lr=0.02, adamw_lr=0.004, warmup_steps=10, min_lr_ratio=0.1)
    model, _ = _pair()
    optimizer = MuonAdamW(muon_groups(cfg, list(model.parameters()), {id(model[1].weight)}), cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule_factor(cfg, s, 100))
    rates = []
    for _ in range(100):
        rates.append(sorted({g["lr"] for g in optimizer.param_groups}))
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx([0.0004, 0.002])  # a tenth of the warm-up
    assert rates[10] == pytest.approx([0.004, 0.02])
    assert rates[99] == pytest.approx([0.0004, 0.002], rel=1e-2)  # 10% of the peak
    assert schedule_factor(OptimizerConfig(), 99, 100) == 0.5 * (1 + math.cos(0.99 * math.pi))  # no floor: as before


def test_its_config_defaults_and_refusals():
    cfg = load_config(SMOKE, ["optimizer={name: muon, lr: 0.02}"]).optimizer
    assert (cfg.momentum, cfg.adamw_rate) == (0.95, 0.002)
    assert load_config(SMOKE, ["optimizer={name: muon, momentum: 0.9}"]).optimizer.momentum == 0.9
    assert load_config(SMOKE).optimizer.momentum == 0.9  # sgd's stays
    one_line_error("only muon has a second rate", load_config, SMOKE, ["optimizer.adamw_lr=0.01"])
    one_line_error("both set", load_config, SMOKE, ["optimizer.schedule_steps=10", "optimizer.schedule_epochs=2"])
    assert load_config(SMOKE, ["train.schedule=async"]).train.delay_correction == "lookahead"
    assert load_config(SMOKE, ["train.schedule=async", "train.delay_correction=none"]).train.delay_correction == "none"
    assert load_config(SMOKE).train.delay_correction == "none"


def test_a_run_with_muon_and_with_nadam_learns(tmp_path):
    from swarm.training.experiment import run_experiment
    from swarm.training.results import read_results

    for optimizer in ("name: muon, lr: 0.1, adamw_lr: 0.01", "name: nadam, lr: 0.01"):
        cfg = load_config(SMOKE, [f"optimizer={{{optimizer}, weight_decay: 0.0}}", "train.epochs=2"])
        run_experiment(cfg, tmp_path / "r.jsonl", progress=False)
        steps = [r["loss"] for r in read_results(tmp_path / "r.jsonl") if r["type"] == "step"]
        assert sum(steps[-5:]) / 5 < 0.6 * sum(steps[:5]) / 5, optimizer
