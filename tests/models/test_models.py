"""Models cut into stages: equivalence with the unsplit model, split plans, user models (GPT-2: test_gpt2.py)."""

from __future__ import annotations

import importlib
import textwrap
import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from swarm.data import build_datasets, collate
from swarm.models import (
    StagedModel,
    build_model,
    classification_metrics,
    plan_cuts,
    summarize,
)
from swarm.models.registry import LIBRARIES, MODELS, model_libraries, stage_count_problem
from swarm.models.resnet import ResNet18


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


def test_a_stage_count_past_the_split_is_found_without_building_weights(tmp_path):
    """What the lab and a stage peer ask before any peer starts: on the meta device, for built-in
    models and transformers configs; not asked of a pretrained model's weights or a user's function."""
    llama = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64}
    llama |= {"num_hidden_layers": 4, "num_attention_heads": 4}
    assert stage_count_problem("digits_cnn", 5, {}) == "digits_cnn: 4 blocks can be split into 1..4 stages, not 5"
    assert stage_count_problem("gpt2", 15, {}) == "gpt2: 12 blocks + stem + head can be split into 1..14 stages, not 15"
    assert stage_count_problem("transformers", 7, {"config": llama}) == (
        "transformers: 4 layers + embedding + head can be split into 1..6 stages, not 7"
    )
    assert stage_count_problem("resnet18", 10, {"width": 16}) is None
    assert stage_count_problem("transformers", 6, {"config": llama}) is None  # its forward cannot run on meta
    assert (
        stage_count_problem("transformers", 7, {"config": llama | {"model_type": "nonsense"}}) is None
    )  # the build's to say
    assert stage_count_problem("gpt2", 15, {"pretrained": str(tmp_path / "nowhere")}) is None
    assert stage_count_problem("gpt2", 30, {"config": "gpt2-medium"}) is None  # a hub lookup: left to the build
    assert stage_count_problem("relay", 1, {}) == (
        "relay: needs at least 2 stages (it exists to load the links between them), got 1"
    )
    assert stage_count_problem("tests_custom_module:build", 99, {}) is None


def test_the_libraries_a_lab_preloads_for_a_model_import():
    """A lab's spawner imports them once for all its peers and passes over one that fails (the
    peer then fails on it itself): a renamed module would only cost time, so it is checked here."""
    assert set(LIBRARIES) <= set(MODELS) and model_libraries("pkg.mod:build") == ()
    for modules in LIBRARIES.values():
        for module in modules:
            importlib.import_module(module)
