"""A language model at the sizes its users train through the swarm: 1024-token blocks, micro-batches
of 8 sequences, the default evaluation batch (200 sequences), through the generic `text` loader
and a GPT-2-format tokenizer whose vocabulary needs 16-bit token ids. Narrow (32 wide), so it
stays fast; its micro-batches still carry 8 x 1024 targets, which in int64 were more than a
request's whole head could hold."""

from __future__ import annotations

import random
import uuid

import pytest
import torch
import yaml
from _swarm_env import assert_close_losses, assert_same_run, local_rows, step_losses
from _util import write_tiny_tokenizer

from protocols import carried as envelope
from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.config import load_config
from swarm.data import collate
from swarm.engine.microbatch import MicroBatch
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.net.calls import call
from swarm.transport.hivemind.net.meta import address, batch_to_meta, micro_batch_payload
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.stage.server import MAX_MESSAGE_HEAD_BYTES

STEPS = 2
BLOCK = 1024
WORDS = "the a of to and in that it was he for on are with as his they be at one have this from or had".split()


def _corpus(path, blocks: int) -> None:
    """Plain text of about `blocks` blocks' worth of tokens (the tiny tokenizer: a byte a token,
    " the" and "the" merged), rows of a few sentences as a text file has them."""
    rng = random.Random(0)
    rows, size = [], 0
    while size < blocks * BLOCK * 1.25:
        row = " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(rng.randint(20, 60)))
        rows.append(row)
        size += len(row) + 1
    path.write_text("\n".join(rows))


@pytest.fixture(scope="module")
def llm_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    (root / "tok").mkdir()
    tokenizer = write_tiny_tokenizer(root / "tok")
    _corpus(root / "train.txt", 2 * STEPS * 16)
    _corpus(root / "test.txt", 205)
    config = {
        "name": "llm-sized",
        "seed": 0,
        "model": {
            "name": "transformers",
            "num_stages": 3,
            "options": {
                "config": {
                    "model_type": "llama",
                    "vocab_size": 260,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "max_position_embeddings": BLOCK,
                    "tie_word_embeddings": True,
                }
            },
        },
        "data": {
            "name": "text",
            "options": {
                "files": [str(root / "train.txt")],
                "test_files": [str(root / "test.txt")],
                "tokenizer": str(tokenizer),
                "block_size": BLOCK,
            },
        },
        "optimizer": {"name": "adamw", "lr": 0.003},
        "train": {"batch_size": 16, "micro_batches": 2, "max_steps": STEPS, "eval_every": 100},
        "compression": {"forward": "topk:0.1", "backward": "topk:reuse"},
    }
    path = root / "llm.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path, [])
    assert cfg.train.eval_batch_size == 200  # the default
    return cfg


def test_a_language_models_micro_batches_carry_16_bit_tokens_and_keep_a_small_head(llm_config):
    train_set, test_set = build_data(llm_config)
    assert len(test_set) >= 200  # evaluation sees one whole default batch
    ids, x, y = collate([train_set[i] for i in range(8)])
    assert x.shape == (8, BLOCK) and int(x.max()) > 255  # merged tokens: 8 bits do not hold them
    batch = MicroBatch(0, 0, ids, y)
    carried, body = envelope.unpack(micro_batch_payload(batch, inputs=x))
    assert carried.inputs.stored == "uint16" and carried.targets_are_inputs and not body
    assert len(carried.inputs.data) == 8 * BLOCK * 2  # a quarter of int64's bytes, sent once for inputs and targets
    onward, _ = envelope.unpack(micro_batch_payload(batch, b"activations"))
    assert onward.targets.stored == "uint16" and not onward.HasField("inputs")
    big = MicroBatch(0, 0, torch.arange(200), torch.randint(0, 50257, (200, 2048)))
    head = pb.MicroBatchHead(to=address("run", 1), batch=batch_to_meta(big), budget_s=10.0, epoch=1, seq=1)
    assert head.ByteSize() < 64  # the head does not grow with the micro-batch


def test_a_1024_token_language_model_trains_through_the_swarm_as_in_one_process(swarm, llm_config, tmp_path):
    """Training micro-batches of 8 x 1024 tokens and the default evaluation batch go through 3
    stage peers; losses and evaluations equal one process's. A stranger's 1 MiB head is refused
    in one line before protobuf parses any of it, and the run goes on."""
    cfg = llm_config
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(s, s) for s in range(cfg.model.num_stages)])
    stranger = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        stage1 = swarm.hosts[1][0].peer_id
        head = pb.MicroBatchHead(to=address(run_id, 1), sender="x" * (1 << 20), budget_s=5)
        with pytest.raises(RemoteError, match=f"besides its chunk's data \\(at most {MAX_MESSAGE_HEAD_BYTES}\\)$"):
            swarm.loop.run(call(stranger.streams, stage1, "micro_batch", head, b"", 10))
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(stranger.shutdown())
    assert_same_run(results.rows, local_rows(cfg, tmp_path, STEPS))
    (evaluation,) = [r for r in results.rows if r["type"] == "eval"]
    assert evaluation["uncompressed"]["perplexity"] > 1


def test_the_language_model_trains_asynchronously_with_its_tied_embedding_summed_across_stages(
    swarm, llm_config, tmp_path
):
    """The same model trained in full under `train.schedule: async` with dc: its embedding (stage 0)
    and LM head (stage 2) are tied, and stage 2 has two replicas. Each step's held round sums each
    stage's replicas, compensates their sum, then ties the two stages' parts; 4 steps of 8 x 1024
    tokens give one process's losses."""
    train_cfg = llm_config.train.model_copy(update={"schedule": "async", "delay_correction": "dc:10", "max_steps": 4})
    cfg = llm_config.model_copy(update={"train": train_cfg})
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2), (2, 3)])
    try:
        data = build_data(cfg)
        results = ResultsWriter(None)
        pipeline = swarm.pipeline(cfg, run_id, 4, data)
        train(cfg, pipeline, data, results, 4, progress=False)
        head = [h.runtime.module.get_parameter("lm_head.weight") for h in hosted if h.stage == 2]
        assert torch.equal(head[0], head[1])
    finally:
        swarm.unhost(run_id)
    assert_close_losses(step_losses(results.rows), step_losses(local_rows(cfg, tmp_path, 4)))
    assert pipeline.summary_notes()["round_calls"]["gather"] >= 4 * 4  # every step by the held round, on every peer
