"""`python -m swarm export` and `generate` in one process: a LoRA run's adapter and merged model,
the zoo's models, the byte tokenizer, and the ways the commands refuse."""

from __future__ import annotations

import json

import pytest
import torch
from _export_cases import loaded_logits, probe, saved_tensors, stage_logits, tiny_llama
from _util import SMOKE, cli_here, refusal
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarm.config import load_config
from swarm.export.exporter import ExportOptions, export_pipeline, export_run
from swarm.export.generate import Sampling, generate, load_language_model
from swarm.export.state import checkpoint_state
from swarm.export.zoo import load_exported
from swarm.training.checkpoints import EXPERIMENT_FILE, Checkpointing
from swarm.training.experiment import build_data, open_results
from swarm.training.loop import Schedule, train
from swarm.transport.local import build_local_pipeline

LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}


def _one_process(cfg, root, steps: int = 4):
    """`cfg` trained in one process, checkpointing at its end into `root`/ck; (pipeline, stages)."""
    data = build_data(cfg)
    pipeline, staged = build_local_pipeline(cfg, Schedule.of(cfg, len(data[0]), steps).lr_horizon, len(data[0]))
    checkpoint = Checkpointing(str(root / "ck"), every=steps)
    results = open_results(None, checkpoint)
    train(cfg, pipeline, data, results, steps, False, checkpoint)
    return pipeline, staged


def test_a_lora_run_exports_its_adapter_for_peft_and_merged_for_transformers(tmp_path, capsys):
    cfg = tiny_llama(tmp_path, lora=LORA, stages=2)
    pipeline, staged = _one_process(cfg, tmp_path)
    tokens = probe()
    stages = stage_logits(staged.stages, tokens)
    said = export_pipeline(pipeline, cfg, 4, ExportOptions(tmp_path / "adapter"))
    assert said[0].startswith(f"peft LoRA adapter of step 4 for base {tmp_path / 'base'}")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(loaded_logits(adapted, tokens), stages, rtol=1e-5, atol=1e-6)

    done = cli_here(capsys, "export", str(tmp_path / "ck"), "--out", str(tmp_path / "merged"), "--merge")
    assert done.returncode == 0, done.stderr
    assert "merged with its LoRA adapters" in done.stdout
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(loaded_logits(merged, tokens), stages, rtol=1e-4, atol=1e-5)  # W + BA, rounded
    assert not torch.equal(merged.model.layers[1].self_attn.q_proj.weight, base.model.layers[1].self_attn.q_proj.weight)


def test_a_zoo_model_exports_as_safetensors_and_the_config_that_rebuilds_it(tmp_path):
    cfg = load_config(SMOKE, ["train.max_steps=2"])
    _, staged = _one_process(cfg, tmp_path, 2)
    said = export_run(checkpoint_state(tmp_path / "ck"), ExportOptions(tmp_path / "model"))
    assert said == [
        f"digits_cnn model of step 2 from checkpoint {tmp_path / 'ck' / 'step-00000002'} in {tmp_path / 'model'}"
        " (model.safetensors, hivepipe_model.json; swarm.export.zoo.load_exported loads it)"
    ]
    config = json.loads((tmp_path / "model" / "hivepipe_model.json").read_text())
    assert config["model"] == cfg.model.model_dump(mode="json") and config["step"] == 2
    assert set(saved_tensors(tmp_path / "model")) == {
        f"stages.{i}.{name}" for i, stage in enumerate(staged.stages) for name in stage.state_dict()
    }
    loaded = load_exported(tmp_path / "model")
    images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(images), stage_logits(staged.stages, images), rtol=0, atol=0)


def test_generate_greedy_writes_what_the_pipeline_sampled_and_the_byte_tokenizer_goes_along(tmp_path, capsys):
    """The byte tokenizer has no files of its own: the export writes its config, which AutoTokenizer
    reads back. Greedy generation from the export at step 4 writes the tokens the pipeline's sample
    of step 4 picked."""
    cfg = tiny_llama(
        tmp_path,
        "data.options.tokenizer=bytes",
        "model.options.config.vocab_size=384",
        "train.sample_every=2",
        "train.sample_tokens=6",
        "train.sample_prompt=the dog",
        "data.options.test_fraction=0.02",
        pretrained=False,
    )
    run = tmp_path / "run.jsonl"
    done = cli_here(capsys, "run", str(_written(cfg, tmp_path)), "--results", str(run), "--export", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    assert "tokenizer: ByT5's UTF-8 bytes" in done.stderr
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert type(tokenizer).__name__ == "ByT5Tokenizer" and tokenizer.eos_token_id == 1
    sample = [json.loads(line) for line in run.read_text().splitlines() if '"sample"' in line][-1]
    assert sample["step"] == 4 and sample["prompt"] == "the dog"
    model, tokenizer = load_language_model(tmp_path / "m")
    assert model.generation_config.eos_token_id == 1  # the tokenizer's, not the llama config's default
    text = generate(model, tokenizer, "the dog", Sampling(max_new_tokens=len(sample["tokens"])))
    assert text == "the dog" + sample["text"]
    done = cli_here(capsys, "generate", str(tmp_path / "m"), "--prompt", "the dog", "--max_new_tokens", "3")
    assert done.returncode == 0 and done.stdout.startswith("the dog"), done.stderr
    sampled = [
        cli_here(
            capsys, "generate", str(tmp_path / "m"), "--prompt", "the", "--temperature", "2", "--seed", seed
        ).stdout
        for seed in ("1", "1", "2")  # 32 tokens each
    ]
    assert sampled[0] == sampled[1] != sampled[2]


def _written(cfg, root):
    import yaml

    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def test_export_and_generate_refuse_in_one_line(tmp_path, capsys):
    cfg = load_config(SMOKE, ["train.max_steps=1"])
    _one_process(cfg, tmp_path, 1)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    assert "give a CHECKPOINT directory or the --initial_peers" in refusal(capsys, "export", "--out", out)
    assert "one of them" in refusal(capsys, "export", ck, "--out", out, "--initial_peers", "/ip4/127.0.0.1/tcp/1")
    assert "--merge: this run's model (digits_cnn) trained no LoRA" in refusal(
        capsys, "export", ck, "--out", out, "--merge"
    )
    assert "--set needs --config" in refusal(capsys, "export", ck, "--out", out, "--set", "seed=1")
    peer = "/ip4/127.0.0.1/tcp/1/p2p/QmbugXX635RKdGMYR1FbYYWYo5Lt7AYxhmtKz2bUVYanuP"
    key = str(tmp_path / "no.key")  # never made up: only the owner's key exports a live run
    said = refusal(capsys, "export", "--initial_peers", peer, "--identity_path", key, "--out", out)
    assert (
        said
        == f"error: --identity_path: no identity file at {key} (the run owner's key, the one its trainer runs with)"
    )
    assert "holds no complete checkpoint" in refusal(capsys, "export", str(tmp_path), "--out", out)
    # the Hub: refused before anything is exported, never reached (HF_HUB_OFFLINE: tests/conftest.py)
    assert "the Hugging Face Hub is off here" in refusal(capsys, "export", ck, "--out", out, "--push_to_hub", "me/it")
    assert "not a repository id" in refusal(capsys, "export", ck, "--out", out, "--push_to_hub", "me/a b")
    assert not (tmp_path / "out").exists()
    (tmp_path / "ck" / "step-00000001" / EXPERIMENT_FILE).unlink()
    assert "pass the run's --config" in refusal(capsys, "export", ck, "--out", out)
    assert cli_here(capsys, "export", ck, "--out", out, "--config", str(SMOKE)).returncode == 0
    assert "a hivepipe model export" in refusal(capsys, "generate", out, "--prompt", "hi")
    assert "--merge needs --export" in refusal(capsys, "run", str(SMOKE), "--merge")
    assert "--merge needs --export" in refusal(capsys, "lab", str(SMOKE), "--stages", "2", "--merge")
    with pytest.raises(ValueError, match=r"train.sample_every: samples need a language model"):
        load_config(SMOKE, ["train.sample_every=1"])
