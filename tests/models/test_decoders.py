"""Any transformers decoder cut into stages: per family, the stages compute what the unsplit model
computes (logits and every parameter's gradient), splits, configs, pretrained weights, errors."""

from __future__ import annotations

import json

import pytest
import torch
from _util import TINY_DECODERS as TINY
from _util import TINY_VOCAB as VOCAB

from swarm.models import build_model
from swarm.models.causal_lm import check_split, load_model
from swarm.models.decoders import CHECKED_FAMILIES, balanced_starts


def test_every_checked_family_has_a_tiny_config():
    assert set(TINY) == set(CHECKED_FAMILIES)


def _pair(family: str, num_stages: int, config_changes: dict | None = None, **options):
    config = {**TINY[family], **(config_changes or {})}
    torch.manual_seed(0)
    whole = load_model(None, config, None)
    torch.manual_seed(0)
    staged = build_model("transformers", num_stages, config=config, **options)
    return whole, staged


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("num_stages", [1, 3])
def test_staged_equals_unsplit(family, num_stages):
    whole, staged = _pair(family, num_stages)
    ids = torch.randint(0, VOCAB, (2, 16))
    whole.eval()
    staged.eval()
    with torch.no_grad():
        assert torch.equal(whole(input_ids=ids).logits, staged(ids))

    # gradients: stage by stage with detached inputs, as the pipeline runs them
    whole.train()
    staged.train()
    loss = whole(input_ids=ids, labels=ids).loss
    loss.backward()
    x, kept = ids, []
    for i, stage in enumerate(staged.stages):
        inp = x if i == 0 else x.detach().requires_grad_(True)
        x = stage(inp)
        kept.append((inp, x))
    staged_loss = staged.loss(x, ids)
    assert torch.allclose(staged_loss, loss, rtol=1e-6)
    staged_loss.backward()
    for i in range(len(kept) - 1, 0, -1):
        kept[i - 1][1].backward(kept[i][0].grad)
    reference = dict(whole.named_parameters(remove_duplicate=False))
    summed: dict[str, torch.Tensor] = {}
    for stage in staged.stages:
        for name, p in stage.named_parameters():
            source = stage.source_names[name]
            summed[source] = p.grad if source not in summed else summed[source] + p.grad
    tied_head = whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    for source, grad in summed.items():
        if (
            tied_head
            and num_stages > 1
            and source == next(n for n, p in reference.items() if p is whole.get_input_embeddings().weight)
        ):
            continue  # the embedding's grad is the sum with the head copy's, checked below
        assert torch.allclose(grad, reference[source].grad, rtol=1e-5, atol=1e-7), (family, source)
    for pair in staged.tied:
        first = staged.stages[pair.first[0]].get_parameter(pair.first[1])
        second = staged.stages[pair.second[0]].get_parameter(pair.second[1])
        assert torch.equal(first, second)
        assert torch.allclose(first.grad + second.grad, whole.get_input_embeddings().weight.grad, rtol=1e-5, atol=1e-7)
    assert bool(staged.tied) == (tied_head and num_stages > 1)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])
def test_a_middle_stage_is_causal_and_positions_restart(family):
    _, staged = _pair(family, 3, split=[1, 3])
    middle = staged.eval().stages[1]
    h = torch.randn(1, 8, 32)
    changed = h.clone()
    changed[:, 6:] += 1.0  # later positions must not influence earlier ones
    with torch.no_grad():
        a, b = middle(h), middle(changed)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_split_options_and_balance():
    _, staged = _pair("llama", 3, split=[0, 4])
    layers = [sorted(int(k) for k in stage.layers.keys()) for stage in staged.stages]
    assert layers == [[], [0, 1, 2, 3], []]  # embedding alone, all layers, head alone
    assert hasattr(staged.stages[0], "embed_tokens") and hasattr(staged.stages[2], "lm_head")
    # balanced by parameters: the embedding and the head weigh as much as layers here
    assert balanced_starts(10, [5] * 4, 10, 3) == [0, 3]
    assert balanced_starts(0, [5] * 4, 0, 4) == [1, 2, 3]
    assert balanced_starts(1, [1, 1], 1, 1) == []
    config = dict(TINY["llama"], num_hidden_layers=8, vocab_size=2000)
    staged = build_model("transformers", 4, config=config)
    sizes = [sum(p.numel() for p in stage.parameters()) for stage in staged.stages]
    layer = sum(p.numel() for p in staged.stages[1].layers["1"].parameters()) if "1" in staged.stages[1].layers else 0
    assert max(sizes) - min(sizes) <= max(layer, 1) * 2 + 2000 * 32, sizes
    for bad, message in (
        ([3], "needs 2 layer index"),
        ([2, 2], "increasing layer indices in 0..4"),
        ([0, 5], "increasing layer indices in 0..4"),
        ("2,3", "list of layer indices"),
    ):
        with pytest.raises(ValueError, match=message):
            build_model("transformers", 3, config=TINY["llama"], split=bad)
    with pytest.raises(ValueError, match="1..6 stages, not 7"):
        build_model("transformers", 7, config=TINY["llama"])


HEADS = r"hidden size \(\d+\) is not a multiple|hidden_size \d+ is not a multiple of num_attention_heads"


def _saved_with_heads(directory, heads: int):
    """A saved tiny llama whose config.json then says `heads` attention heads (not dividing its width)."""
    load_model(None, TINY["llama"], None).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_attention_heads": heads}))
    return directory


def test_config_errors_are_one_line(tmp_path):
    cases = [
        (dict(config=dict(TINY["llama"], hiden_size=3)), "llama config has no key"),
        (dict(config={"model_type": "no_such_family"}), "unknown model_type"),
        (dict(config={"hidden_size": 3}), "mapping with a model_type"),
        (dict(), "exactly one of options.pretrained"),
        (dict(pretrained=str(tmp_path / "missing"), config=TINY["llama"]), "exactly one of"),
        (dict(pretrained=str(tmp_path / "missing")), "cannot load"),
        (dict(config={"model_type": "t5"}), "encoder-decoder|cannot"),
        (dict(config=dict(TINY["falcon"], alibi=True)), "^transformers: falcon with alibi positions is not supported$"),
        # transformers 5 validates llama's config (huggingface_hub's error is no ValueError); qwen2's
        # runs into a shape mismatch; a saved config.json is validated as it loads
        (dict(config=dict(TINY["llama"], hidden_size=30, num_attention_heads=4)), HEADS),
        (dict(config=dict(TINY["qwen2"], hidden_size=30, num_attention_heads=4)), HEADS),
        # (transformers 5.0 loads that config.json, then refuses the weights, whose shapes differ)
        (dict(pretrained=str(_saved_with_heads(tmp_path / "saved", 5))), rf"{HEADS}|cannot load '.*saved' \(.*sizes"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            build_model("transformers", 2, **options)
        assert "\n" not in str(caught.value)


def test_pretrained_weights_load(tmp_path):
    torch.manual_seed(3)
    whole = load_model(None, TINY["qwen2"], None)
    whole.save_pretrained(tmp_path / "tiny")
    torch.manual_seed(99)  # pretrained weights do not depend on the seed
    staged = build_model("transformers", 2, pretrained=str(tmp_path / "tiny"))
    reference = dict(whole.named_parameters())
    for stage in staged.stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, reference.get(stage.source_names[name], reference["model.embed_tokens.weight"]))


def test_a_split_that_computes_something_else_is_refused():
    torch.manual_seed(0)
    whole = load_model(None, TINY["llama"], None)
    _, staged = _pair("llama", 2)
    check_split(whole, staged)  # the same weights: accepted
    with torch.no_grad():
        staged.stages[1].norm.weight.mul_(2.0)  # not the unsplit model's weights any more
        staged.stages[1].norm.weight.data = staged.stages[1].norm.weight.data.clone()
    with pytest.raises(ValueError, match="computes something else when split"):
        check_split(whole, staged)


def test_configs_transformers_takes_and_outputs_a_split_cannot_keep():
    legacy = build_model("transformers", 2, config=dict(TINY["llama"], rope_theta=5e5))  # folded into rope_parameters
    assert legacy.stages[1].config.rope_parameters["rope_theta"] == 5e5
    capped = build_model("transformers", 2, config=dict(TINY["gemma2"], final_logit_softcapping=1.0))  # tanh itself
    assert capped.stages[1].logit_transforms  # (built: the probe found the split's logits equal)
    # OPT-350m's shape: no final norm (its layers normalize after), projections in and out
    whole, staged = _pair("opt", 3, config_changes={"do_layer_norm_before": False})
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert torch.equal(whole.eval()(input_ids=ids).logits, staged.eval()(ids))
    assert "final_layer_norm" not in dict(staged.stages[2].named_children())
    with pytest.raises(ValueError, match="^transformers: opt with layerdrop set is not supported$"):
        build_model("transformers", 2, config=dict(TINY["opt"], layerdrop=0.1))  # layers skipped at random
    with pytest.raises(ValueError, match="cannot load .*FlashAttention"):
        build_model("transformers", 2, config=TINY["llama"], attn_implementation="flash_attention_2")


def test_layers_whose_forward_takes_no_keywords_beyond_its_own_get_only_those(monkeypatch):
    """Bloom's layers in transformers 5.0 take no `position_ids` (newer releases take **kwargs):
    a stage passes a layer only the arguments its forward names, and still computes what the
    unsplit model computes."""
    from transformers.models.bloom import modeling_bloom

    original = modeling_bloom.BloomBlock.forward

    def named_only(self, hidden_states, alibi, attention_mask, layer_past=None, use_cache=False, **rest):
        return original(self, hidden_states, alibi, attention_mask, layer_past=layer_past, use_cache=use_cache, **rest)

    def strict(
        self,
        hidden_states,
        alibi,
        attention_mask,
        layer_past=None,
        use_cache=False,
        output_attentions=False,
        cache_position=None,
    ):  # what the unsplit model passes, in 5.0 and later
        return named_only(self, hidden_states, alibi, attention_mask, layer_past, use_cache)

    monkeypatch.setattr(modeling_bloom.BloomBlock, "forward", strict)
    whole, staged = _pair("bloom", 3)
    ids = torch.randint(0, VOCAB, (2, 16))
    whole.eval()
    staged.eval()
    monkeypatch.setattr(modeling_bloom.BloomBlock, "forward", named_only)  # the unsplit model's own call
    with torch.no_grad():
        assert torch.equal(whole(input_ids=ids).logits, staged(ids))
