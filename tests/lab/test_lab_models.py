"""Your own model and data through `python -m swarm lab`: a pretrained transformers decoder with LoRA
on a local text file, as separate processes over hivemind, equals one process (the oracle)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml
from _swarm_env import assert_same_run, local_rows
from _util import REPO

from swarm.config import config_from_text
from swarm.engine.checkpoint import read_stage
from swarm.training.results import read_results

sys.path.insert(0, str(REPO / "tests" / "models"))
from test_lora import lora_config  # noqa: E402  (the same tiny pretrained Llama, tokenizer and text)

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)


def test_lora_decoder_on_local_text_through_the_swarm_equals_one_process(tmp_path):
    raw = lora_config(tmp_path)
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(raw))
    results = tmp_path / "lab.jsonl"
    command = [
        sys.executable,
        "-m",
        "swarm",
        "lab",
        str(path),
        "--stages",
        "2",
        "--steps",
        "2",
        "--results",
        str(results),
    ]
    command += ["--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "2", "--set", "train.eval_every=100"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    cfg = config_from_text(path.read_text(), ["train.eval_every=100"], "test")
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))
    saved = tmp_path / "ck" / "step-00000002"
    assert (saved / "adapter" / "adapter_model.safetensors").is_file()
    # the stage peers sent adapters only: none from stage 0 (its frozen embedding alone), stage 1's
    # trained B matrices no longer zero
    assert read_stage(saved / "stage0.pt")["module"] == {}
    state = read_stage(saved / "stage1.pt")
    assert state["module"] and all("lora_" in name for name in state["module"])
    assert any(torch.count_nonzero(v) for name, v in state["module"].items() if "lora_B" in name)
