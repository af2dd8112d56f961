"""Models cut into stages: equivalence with the unsplit model, split plans, tied weights, user models."""

from __future__ import annotations

import textwrap
import uuid

import pytest
import torch
from _util import sync_tied, tied_weight_drift
from torch import nn
from torch.utils.data import DataLoader

from swarm.data import build_datasets, collate
from swarm.models import (
    StagedModel,
    TiedPair,
    build_model,
    causal_lm_loss,
    causal_lm_metrics,
    classification_metrics,
    plan_cuts,
    summarize,
)
from swarm.models.gpt2 import load_full
from swarm.models.resnet import ResNet18

TINY_GPT2 = dict(
    n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)


def staged_params(staged: StagedModel) -> list[torch.Tensor]:
    return [p for stage in staged.stages for p in stage.parameters()]


# ---- split plans ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "blocks, stages, cuts",
    [
        (8, 1, []),
        (8, 2, [3]),
        (8, 4, [1, 3, 5]),  # resnet18: after layer1, layer2, layer3
        (12, 4, [2, 5, 8]),  # gpt2-small: after blocks 2, 5, 8
        (8, 9, [0, 1, 2, 3, 4, 5, 6, 7]),  # the head alone
        (8, 10, [-1, 0, 1, 2, 3, 4, 5, 6, 7]),  # and the stem alone
        (2, 4, [-1, 0, 1]),
    ],
)
def test_plan_cuts(blocks, stages, cuts):
    assert plan_cuts("m", blocks, stages) == cuts


def test_plan_cuts_rejects_impossible_splits():
    with pytest.raises(ValueError, match=r"1\.\.10 stages, not 11"):
        plan_cuts("resnet18", 8, 11)
    with pytest.raises(ValueError, match="1..4 stages"):
        plan_cuts("m", 4, 5, stem=False, head=False)
    with pytest.raises(ValueError, match="positive integer"):
        plan_cuts("m", 4, 0)
    with pytest.raises(ValueError, match="increasing"):
        plan_cuts("m", 8, 3, split_after=[4, 2])
    with pytest.raises(ValueError, match="needs 2 cut"):
        plan_cuts("m", 8, 3, split_after=[4])


# ---- ResNet-18 --------------------------------------------------------------------------------


def test_resnet_boundary_shapes_width64():
    torch.manual_seed(0)
    staged = build_model("resnet18", 4)
    x = torch.randn(2, 3, 32, 32)
    shapes = []
    with torch.no_grad():
        for stage in staged.stages[:-1]:
            x = stage(x)
            shapes.append(tuple(x.shape))
        logits = staged.stages[-1](x)
    assert shapes == [(2, 64, 32, 32), (2, 128, 16, 16), (2, 256, 8, 8)]
    assert logits.shape == (2, 10)
    assert [name for name, _ in staged.stages[0].named_children()] == ["stem", "layer1_0", "layer1_1"]
    assert [name for name, _ in staged.stages[3].named_children()] == ["layer4_0", "layer4_1", "head"]


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5, 9, 10])
def test_resnet_split_equals_unsplit(num_stages):
    torch.manual_seed(3)
    full = ResNet18(num_classes=7, width=4)
    torch.manual_seed(3)
    staged = build_model("resnet18", num_stages, num_classes=7, width=4)
    assert len(staged.stages) == num_stages
    assert all(any(True for _ in s.parameters()) for s in staged.stages)
    full_params = list(full.parameters())
    assert len(full_params) == len(staged_params(staged))
    for a, b in zip(full_params, staged_params(staged), strict=True):
        assert torch.equal(a, b)  # the split never changes initialisation

    x = torch.randn(3, 3, 32, 32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    targets = torch.tensor([0, 3, 6])
    y1, y2 = full(x1), staged(x2)
    assert torch.allclose(y1, y2, atol=1e-6)
    nn.functional.cross_entropy(y1, targets).backward()
    staged.loss(y2, targets).backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-7)
    for a, b in zip(full_params, staged_params(staged), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_resnet_explicit_split_and_options():
    staged = build_model("resnet18", 2, width=4, in_channels=1, num_classes=3, split_after=[5])
    assert [n for n, _ in staged.stages[1].named_children()] == ["layer4_0", "layer4_1", "head"]
    assert staged(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    with pytest.raises(ValueError, match="1..10 stages, not 12"):
        build_model("resnet18", 12, width=4)
    with pytest.raises(ValueError, match="width must be a positive integer"):
        build_model("resnet18", 4, width=0)
    with pytest.raises(ValueError, match="unknown option.*depth.*allowed: num_classes"):
        build_model("resnet18", 4, depth=3)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'resnet99'.*resnet18"):
        build_model("resnet99", 2)
    with pytest.raises(ValueError, match="num_stages must be a positive integer"):
        build_model("resnet18", 0)


# ---- GPT-2 ------------------------------------------------------------------------------------


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
            output.retain_grad()
            captured[index] = output

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
    params = staged_params(staged)
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


@pytest.mark.parametrize("name, most", [("digits_cnn", 4), ("digits_mlp", 3)])
def test_digits_models_split(name, most):
    x = torch.randn(5, 1, 8, 8)
    torch.manual_seed(0)
    reference = build_model(name, 1)
    for n in range(1, most + 1):
        torch.manual_seed(0)
        staged = build_model(name, n)
        assert len(staged.stages) == n
        assert torch.equal(staged(x), reference(x))
    with pytest.raises(ValueError, match=f"1..{most} stages"):
        build_model(name, most + 1)


def test_digits_cnn_boundaries():
    staged = build_model("digits_cnn", 4, width=8, hidden=16)
    x = torch.randn(2, 1, 8, 8)
    shapes = []
    for stage in staged.stages:
        x = stage(x)
        shapes.append(tuple(x.shape))
    assert shapes == [(2, 8, 8, 8), (2, 16, 4, 4), (2, 16), (2, 10)]


def test_digits_cnn_learns_digits():
    train, test = build_datasets("digits")
    torch.manual_seed(0)
    staged = build_model("digits_cnn", 2)
    opt = torch.optim.SGD(staged_params(staged), lr=0.05, momentum=0.9, weight_decay=5e-4)
    order = torch.Generator().manual_seed(0)
    for _ in range(5):  # not 3: after 3 epochs some shuffle orders end just below the bar
        staged.train()
        for _ids, x, y in DataLoader(train, 100, shuffle=True, generator=order, collate_fn=collate):
            opt.zero_grad()
            staged.loss(staged(x), y).backward()
            opt.step()
    staged.eval()
    totals: dict[str, float] = {}
    with torch.no_grad():
        for _ids, x, y in DataLoader(test, 300, collate_fn=collate):
            for k, v in staged.metrics(staged(x), y).items():
                totals[k] = totals.get(k, 0.0) + v
    assert totals["count"] == len(test)
    assert summarize(totals)["accuracy"] > 0.9


# ---- custom models ---------------------------------------------------------------------------

CUSTOM = """
import torch
from torch import nn
from swarm.models import StagedModel, classification_loss, classification_metrics
from _util import sync_tied, tied_weight_drift

def as_tuple(num_stages, hidden=4):
    stages = [nn.Linear(3, hidden)] + [nn.Linear(hidden, hidden) for _ in range(num_stages - 2)] + [nn.Linear(hidden, 2)]
    return stages, nn.functional.cross_entropy

def as_staged(num_stages):
    stages = [nn.Linear(3, 3) for _ in range(num_stages)]
    return StagedModel(stages, classification_loss, classification_metrics, [])

def wrong_count(num_stages):
    return [nn.Linear(3, 3)], nn.functional.cross_entropy

def not_a_model(num_stages):
    return 42

def not_a_module(num_stages):
    return ["stage"], nn.functional.cross_entropy

VALUE = 3
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(CUSTOM))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_custom_model_tuple_gets_default_metrics(custom_module):
    staged = build_model(f"{custom_module}:as_tuple", 3, hidden=5)
    assert isinstance(staged, StagedModel) and len(staged.stages) == 3
    assert staged.stages[1].in_features == 5
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    out = staged(x)
    m = staged.metrics(out, y)
    assert m["count"] == 4 and m["correct"] == float((out.argmax(dim=-1) == y).sum())
    assert m["loss_sum"] == pytest.approx(4 * float(staged.loss(out.detach(), y)), rel=1e-5)


def test_custom_model_staged(custom_module):
    staged = build_model(f"{custom_module}:as_staged", 2)
    assert len(staged.stages) == 2 and staged.metrics is classification_metrics


@pytest.mark.parametrize(
    "target, options, message",
    [
        ("no_such_module_xyz:f", {}, "cannot import module 'no_such_module_xyz'"),
        ("{m}:missing", {}, "has no attribute 'missing'"),
        ("{m}:VALUE", {}, "is a int, not a callable"),
        ("{m}:", {}, "expected 'package.module:function'"),
        ("{m}:not_a_model", {}, "returned int; expected a StagedModel"),
        ("{m}:not_a_module", {}, "stage 0 is not a torch.nn.Module"),
        ("{m}:wrong_count", {}, "built 1 stages, asked for 2"),
        ("{m}:as_staged", {"width": 3}, "cannot be called with num_stages and options"),
    ],
)
def test_custom_model_errors(custom_module, target, options, message):
    with pytest.raises(ValueError, match=message) as info:
        build_model(target.format(m=custom_module), 2, **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("boundary", "shape"),
    [("resnet18.layer1", (64, 32, 32)), ("resnet18.layer2", (128, 16, 16)), ("gpt2", (1024, 768))],
)
def test_relay_carries_real_boundary_sizes_through_every_stage(boundary, shape):
    model = build_model("relay", 4, boundary=boundary)
    x = torch.randn(2, 3, 32, 32)
    for stage in model.stages[:-1]:
        x = stage(x)
        assert tuple(x.shape) == (2, *shape)
    assert tuple(model.stages[-1](x).shape) == (2, 10)
    with pytest.raises(ValueError, match="boundary must be one of"):
        build_model("relay", 4, boundary="vgg")
    with pytest.raises(ValueError, match="at least 2 stages"):
        build_model("relay", 1)
