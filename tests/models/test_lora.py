"""LoRA through peft on a staged decoder: only adapters train, states hold only adapters, and the
saved adapter directory loads with peft onto the pretrained model and computes what the stages do."""

from __future__ import annotations

import pytest
import torch
import yaml
from _util import TINY_DECODERS, write_tiny_tokenizer

from swarm.config import config_from_text
from swarm.engine.checkpoint import module_state
from swarm.models import build_model
from swarm.models.causal_lm import load_model
from swarm.training.checkpoints import Checkpointing, latest_run
from swarm.training.experiment import build_data, open_results
from swarm.training.loop import Schedule, train
from swarm.training.results import read_results
from swarm.transport.local import build_local_pipeline

LLAMA = dict(TINY_DECODERS["llama"], vocab_size=300)  # the tiny tokenizer has 260 tokens
LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "dropout": 0.1}  # masks per micro-batch
TEXT = "".join(f"the cat {i} sat on the mat, then the dog {i * 7 % 13} ran.\n" for i in range(200))


def lora_config(root, **changes) -> dict:
    """A run config: a pretrained tiny Llama in `root`/base with LoRA, text data in `root`."""
    if not (root / "base").is_dir():
        torch.manual_seed(1)
        load_model(None, LLAMA, None).save_pretrained(root / "base")
        write_tiny_tokenizer(root)
        (root / "train.txt").write_text(TEXT)
    raw = {
        "name": "lora-test",
        # stage 0 holds only the frozen embedding: nothing to train there, nothing to send back
        "model": {
            "name": "transformers",
            "num_stages": 2,
            "options": {"pretrained": str(root / "base"), "lora": LORA, "split": [0]},
        },
        "data": {
            "name": "text",
            "options": {"files": [str(root / "train.txt")], "tokenizer": str(root), "block_size": 16},
        },
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"},
        "train": {"batch_size": 8, "micro_batches": 2, "eval_batch_size": 16, "eval_every": 100, "max_steps": 3},
        "compression": {"forward": "topk:0.3", "backward": "topk:reuse"},
    }
    for key, value in changes.items():
        raw[key] = {**raw[key], **value}
    return raw


def test_only_adapters_train_and_states_hold_only_them(tmp_path):
    cfg = config_from_text(yaml.safe_dump(lora_config(tmp_path)), [], "test")
    data = build_data(cfg)
    schedule = Schedule.of(cfg, len(data[0]), 3)
    pipeline, staged = build_local_pipeline(cfg, schedule.lr_horizon, capacity=len(data[0]))
    before = {(i, n): p.detach().clone() for i, s in enumerate(staged.stages) for n, p in s.named_parameters()}
    trainable = {key for key in before if "lora_" in key[1]}
    assert trainable and all(
        staged.stages[i].get_parameter(n).requires_grad == (key in trainable) for key in before for i, n in [key]
    )
    assert {n.split(".")[-3] for _, n in trainable} == {"lora_A", "lora_B"}
    for runtime in pipeline.runtimes:  # optimizer state only for adapters
        held = {id(p) for group in runtime.optimizer.param_groups for p in group["params"]}
        assert held == {id(p) for n, p in runtime.module.named_parameters() if "lora_" in n}
        assert set(module_state(runtime.module)) == {n for n, _ in runtime.module.named_parameters() if "lora_" in n}

    checkpoint = Checkpointing(str(tmp_path / "ck"), every=3)
    results = open_results(tmp_path / "run.jsonl", checkpoint)
    try:
        train(cfg, pipeline, data, results, 3, False, checkpoint)
    finally:
        results.close()
    changed = {
        key for key, value in before.items() if not torch.equal(value, staged.stages[key[0]].get_parameter(key[1]))
    }
    assert changed and changed <= trainable  # the base never moves
    assert any("lora_B" in n for _, n in changed)  # B starts at zero: trained adapters are no-ops no more

    # the adapters, saved apart, load with peft onto the pretrained weights and compute what the stages do
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = latest_run(tmp_path / "ck") / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), adapter).eval()
    ids = torch.randint(0, 260, (2, 16))
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, staged.eval()(ids), atol=1e-5)
    stage_file = latest_run(tmp_path / "ck") / "stage0.pt"
    assert stage_file.stat().st_size < 64 * 1024  # adapters only, not the 40k-parameter base


def test_lora_and_vocabulary_errors_are_one_line(tmp_path):
    raw = lora_config(tmp_path)
    cases = [
        ({"lora": {"r": 0}}, "r must be a positive integer"),
        ({"lora": {"rank": 4}}, "unknown key"),
        ({"lora": {"targets": ["no_such_module"]}}, "lora: "),
        ({"lora": {"targets": "q_proj"}}, "targets must be a list"),
        ({"lora": {"targets": ["q_proj", "lm_head"]}}, "targets lm_head are not supported"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            build_model("transformers", 2, pretrained=str(tmp_path / "base"), **options)
        assert "\n" not in str(caught.value)
    small = dict(LLAMA, vocab_size=97)
    raw["model"]["options"] = {"config": small}
    cfg = config_from_text(yaml.safe_dump(raw), [], "test")
    with pytest.raises(ValueError, match="does not fit the model's vocabulary of 97"):
        build_data(cfg)


def test_lora_keeps_a_layer_in_the_first_stage_by_default(tmp_path):
    lora_config(tmp_path)
    for stages in (2, 4):  # balanced by parameters, stage 0 would be the embedding alone here
        staged = build_model("transformers", stages, pretrained=str(tmp_path / "base"), lora=LORA)
        assert len(staged.stages[0].layers) >= 1
        assert any(p.requires_grad for p in staged.stages[0].parameters())
    plain = build_model("transformers", 4, pretrained=str(tmp_path / "base"))
    assert len(plain.stages[0].layers) == 0


def test_muon_trains_the_adapter_matrices_and_only_them(tmp_path):
    """LoRA's A and B are the hidden blocks' matrices: Muon takes them all (nothing is left for
    AdamW), the base never moves, and the loss falls."""
    raw = lora_config(tmp_path, optimizer={"name": "muon", "lr": 0.05}, train={"max_steps": 6})
    cfg = config_from_text(yaml.safe_dump(raw), [], "test")
    data = build_data(cfg)
    pipeline, staged = build_local_pipeline(cfg, 6, capacity=len(data[0]))
    adapters = {id(p) for s in staged.stages for n, p in s.named_parameters() if "lora_" in n}
    muon = {
        id(p) for r in pipeline.runtimes for g in r.optimizer.param_groups if g["kind"] == "muon" for p in g["params"]
    }
    others = [
        p for r in pipeline.runtimes for g in r.optimizer.param_groups if g["kind"] != "muon" for p in g["params"]
    ]
    assert muon == adapters and not others
    before = {id(p): p.detach().clone() for s in staged.stages for p in s.parameters() if id(p) not in adapters}
    results = open_results(tmp_path / "run.jsonl", None)
    try:
        train(cfg, pipeline, data, results, 6, False, None)
    finally:
        results.close()
    assert all(torch.equal(v, p) for s in staged.stages for p in s.parameters() if (v := before.get(id(p))) is not None)
    losses = [r["loss"] for r in read_results(tmp_path / "run.jsonl") if r["type"] == "step"]
    assert len(losses) == 6 and losses[-1] < losses[0]
