"""GPT-2 through the decoder split: the stages equal transformers' GPT2LMHeadModel (outputs, gradients,
dropout), its splits and errors, tied embedding sync, and the language-model metrics."""

from __future__ import annotations

import pytest
import torch
from _util import sync_tied, tied_weight_drift
from torch import nn

from swarm.models import (
    TiedPair,
    build_model,
    causal_lm_loss,
    causal_lm_metrics,
    classification_metrics,
    plan_cuts,
    summarize,
)
from swarm.models.gpt2 import load_full

TINY_GPT2 = dict(
    n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)


# ---- split plans ------------------------------------------------------------------------------


def _hf_name(name: str) -> str:
    return "transformer.wte.weight" if name == "lm_head.weight" else f"transformer.{name}"


@pytest.mark.parametrize("num_stages", [2, 3, 4, 6])
def test_gpt2_split_equals_hf_model(num_stages):
    torch.manual_seed(0)
    hf = load_full(TINY_GPT2)
    torch.manual_seed(0)
    staged = build_model("gpt2", num_stages, config=TINY_GPT2)
    assert staged.tied == [TiedPair((0, "wte.weight"), (num_stages - 1, "lm_head.weight"))]
    ids = torch.randint(0, 100, (2, 12))

    # boundary activations of the HF model, to compare their gradients with the stages' inputs
    cuts = plan_cuts("gpt2", 4, num_stages)
    captured = {}

    def keep(index):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output  # a tuple before transformers 5.x's layers
            hidden.retain_grad()
            captured[index] = hidden

        return hook

    handles = [hf.transformer.h[c].register_forward_hook(keep(c)) for c in cuts if c >= 0]
    if -1 in cuts:
        handles.append(hf.transformer.drop.register_forward_hook(keep(-1)))
    out = hf(ids, labels=ids)
    for h in handles:
        h.remove()

    # forward and backward stage by stage, as the pipeline does: each stage gets a detached input
    x = ids
    saved = []
    for i, stage in enumerate(staged.stages):
        inp = x if i == 0 else x.detach().requires_grad_(True)
        x = stage(inp)
        saved.append((inp, x))
    loss = staged.loss(x, ids)
    assert torch.allclose(out.logits, x, atol=1e-5)
    assert torch.allclose(out.loss, loss, atol=1e-6)
    out.loss.backward()
    loss.backward()
    for i in range(num_stages - 2, -1, -1):
        grad = saved[i + 1][0].grad
        assert torch.allclose(captured[cuts[i]].grad, grad, atol=1e-6)  # boundary input gradients
        saved[i][1].backward(grad)
    sync_tied(staged.stages, staged.tied)

    hf_params = dict(hf.named_parameters())
    hf_params["transformer.wte.weight"] = hf.transformer.wte.weight
    checked = 0
    for stage in staged.stages:
        for name, p in stage.named_parameters():
            ref = hf_params[_hf_name(name)]
            assert torch.equal(p.detach(), ref.detach()), name
            assert torch.allclose(p.grad, ref.grad, atol=1e-5), name
            checked += 1
    assert checked == len(list(hf.parameters())) + 1  # plus the LM head's own copy


def test_gpt2_default_split_and_single_stage():
    config = dict(n_layer=12, n_embd=8, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(1)
    four = build_model("gpt2", 4, config=config)
    blocks = [sorted(int(k) for k in stage.h.keys()) for stage in four.stages]
    assert blocks == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert hasattr(four.stages[0], "wte") and not hasattr(four.stages[1], "wte")
    assert hasattr(four.stages[3], "lm_head") and not hasattr(four.stages[2], "lm_head")
    torch.manual_seed(1)
    one = build_model("gpt2", 1, config=config)
    assert one.tied == []
    assert one.stages[0].lm_head.weight is one.stages[0].wte.weight  # truly shared in one stage
    params_four = {n: p for s in four.stages for n, p in s.named_parameters()}
    params_one = dict(one.stages[0].named_parameters())
    assert set(params_four) == set(params_one) | {"lm_head.weight"}
    for name, p in params_one.items():
        assert torch.equal(p, params_four[name]), name
    assert torch.equal(params_four["lm_head.weight"], params_one["wte.weight"])
    four.eval()
    one.eval()
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert torch.equal(four(ids), one(ids))
    assert four.stages[1](torch.randn(2, 5, 8)).shape == (2, 5, 8)  # a middle stage runs standalone


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_middle_stage_is_causal(attention):
    torch.manual_seed(0)
    config = dict(TINY_GPT2, attn_implementation=attention, initializer_range=0.5)  # attention that matters
    staged = build_model("gpt2", 3, config=config).eval()
    assert staged.stages[1].config._attn_implementation == attention
    middle = staged.stages[1]
    h = torch.randn(1, 6, 32)
    changed = h.clone()
    changed[:, 4:] += 1.0  # later positions must not influence earlier outputs
    with torch.no_grad():
        a, b = middle(h), middle(changed)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_gpt2_dropout_matches_hf_under_same_seed():
    config = dict(TINY_GPT2, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, attn_implementation="eager")
    torch.manual_seed(0)
    hf = load_full(config).train()
    torch.manual_seed(0)
    staged = build_model("gpt2", 4, config=config).train()
    ids = torch.randint(0, 100, (2, 10))
    torch.manual_seed(5)
    a = hf(ids).logits
    torch.manual_seed(5)
    b = staged(ids)
    assert torch.allclose(a, b, atol=1e-5)


def test_gpt2_pretrained_and_config_from_a_local_directory(tmp_path):
    torch.manual_seed(0)
    saved = load_full(TINY_GPT2)
    saved.save_pretrained(tmp_path / "tiny")
    staged = build_model("gpt2", 2, pretrained=str(tmp_path / "tiny"), config=dict(resid_pdrop=0.0))
    assert torch.equal(staged.stages[0].wte.weight, saved.transformer.wte.weight)
    assert torch.equal(staged.stages[1].lm_head.weight, saved.transformer.wte.weight)
    assert torch.equal(staged.stages[1].h["3"].mlp.c_fc.weight, saved.transformer.h[3].mlp.c_fc.weight)
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.allclose(staged.eval()(ids), saved.eval()(ids).logits, atol=1e-5)
    from_config = build_model("gpt2", 2, config=str(tmp_path / "tiny"))  # architecture only, fresh weights
    assert from_config.stages[0].config.n_layer == 4
    with pytest.raises(ValueError, match="cannot load pretrained weights"):
        build_model("gpt2", 2, pretrained=str(tmp_path / "nothing_here"))


def test_gpt2_errors():
    with pytest.raises(ValueError, match="unknown config key.*n_layers"):
        build_model("gpt2", 2, config=dict(n_layers=2))
    # a value of the wrong type (refused by the config or the model), heads that do not divide the width
    cases = {  # transformers 5.0 takes the wrong type in the config, and the model refuses it
        "^gpt2: (bad config \\(.*n_embd|cannot build the model \\()": dict(TINY_GPT2, n_embd="x"),
        "^gpt2: cannot build the model \\(.*divisible by num_heads": dict(TINY_GPT2, n_embd=30, n_head=4),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message) as caught:
            build_model("gpt2", 2, config=bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="1..6 stages, not 7"):
        build_model("gpt2", 7, config=TINY_GPT2)
    staged = build_model("gpt2", 2, config=TINY_GPT2)
    with pytest.raises(ValueError, match="exceeds the 64 positions"):
        staged(torch.zeros(1, 65, dtype=torch.long))


def test_causal_lm_metrics_match_loss():
    logits = torch.randn(2, 7, 11)
    labels = torch.randint(0, 11, (2, 7))
    m = causal_lm_metrics(logits, labels)
    assert m["count"] == 12
    assert m["loss_sum"] / m["count"] == pytest.approx(float(causal_lm_loss(logits, labels)), rel=1e-5)
    expected = (logits[:, :-1].argmax(-1) == labels[:, 1:]).sum()
    assert m["correct"] == float(expected)
    s = summarize(m)
    assert s["perplexity"] == pytest.approx(torch.exp(causal_lm_loss(logits, labels)).item(), rel=1e-5)


def test_classification_metrics_are_sums():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    m = classification_metrics(logits, torch.tensor([0, 1, 1]))
    assert m["correct"] == 2 and m["count"] == 3
    assert summarize(m)["accuracy"] == pytest.approx(2 / 3)


# ---- tied parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tied_gradient_sync_keeps_copies_identical(optimizer):
    torch.manual_seed(0)
    staged = build_model("gpt2", 3, config=TINY_GPT2)
    wte = staged.stages[0].wte.weight
    head = staged.stages[2].lm_head.weight
    assert wte is not head and torch.equal(wte, head)
    params = [p for stage in staged.stages for p in stage.parameters()]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 8))
        opt.zero_grad()
        staged.loss(staged(ids), ids).backward()
        g_first, g_second = wte.grad.clone(), head.grad.clone()
        assert not torch.allclose(g_first, g_second)
        sync_tied(staged.stages, staged.tied)
        assert torch.equal(wte.grad, g_first + g_second)
        assert torch.equal(head.grad, g_first + g_second)
        opt.step()
        assert tied_weight_drift(staged.stages, staged.tied) == 0.0
    # without the sync the copies drift apart
    ids = torch.randint(0, 100, (2, 8))
    opt.zero_grad()
    staged.loss(staged(ids), ids).backward()
    opt.step()
    assert tied_weight_drift(staged.stages, staged.tied) > 0.0


def test_tying_handles_a_missing_gradient():
    a, b = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
    b.weight.data.copy_(a.weight.data)
    a.weight.grad = torch.ones(2, 2)
    pair = TiedPair((0, "weight"), (1, "weight"))
    sync_tied([a, b], [pair])
    assert torch.equal(b.weight.grad, torch.ones(2, 2)) and b.weight.grad is not a.weight.grad
    with pytest.raises(ValueError, match="not a parameter of stage 1"):
        sync_tied([a, b], [TiedPair((0, "weight"), (1, "bias"))])


# ---- digits models ---------------------------------------------------------------------------
