"""The pipeline engine with its in-process transport: numerics, bytes, eval paths, warmup."""

from __future__ import annotations

import math

import pytest
import torch
from _util import SMOKE, tied_weight_drift

from protocols import PayloadError, wire
from protocols.message import Encoded
from swarm.compression import parse
from swarm.config import load_config
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.training.experiment import run_experiment
from swarm.transport.local import build_local_pipeline


def cfg_with(*overrides: str):
    return load_config(SMOKE, list(overrides))


def a_batch(cfg, size: int = 8):
    from swarm.data import build_datasets, collate

    train, _ = build_datasets(cfg.data.name, data_dir=cfg.data.data_dir, seed=cfg.seed, **cfg.data.options)
    return collate([train[i] for i in range(size)])


def run_one(pipeline, batch, mode=Mode.TRAIN, exact=False, step=0, index=0):
    """`batch`: (ids, inputs, targets), as a_batch gives them."""
    ids, x, y = batch
    return pipeline.run_many([(MicroBatch(step, index, ids, y, mode, 1.0, exact), x)])[0]


def stage_grads(pipeline):
    """The step's summed gradients, as one process's step sets them (swarm.engine.exactsum)."""
    for runtime in pipeline.runtimes:
        runtime.accumulate_held()
    return [p.grad.clone() for runtime in pipeline.runtimes for p in runtime.module.parameters()]


def test_codec_none_equals_unsplit_model():
    cfg = cfg_with("compression.forward=none", "compression.backward=none")
    pipeline, staged = build_local_pipeline(cfg, total_steps=10)
    ids, x, y = a_batch(cfg)
    metrics = run_one(pipeline, (ids, x, y))

    reference, _ = build_local_pipeline(cfg_with("model.num_stages=1"), total_steps=10)
    ref_staged = reference.runtimes[0].module
    ref_staged.train()
    loss = staged.loss(ref_staged(x), y)
    loss.backward()
    assert math.isclose(metrics["loss"], float(loss.detach()), rel_tol=1e-6)
    ours = torch.cat([g.flatten() for g in stage_grads(pipeline)])
    theirs = torch.cat([p.grad.flatten() for p in ref_staged.parameters()])
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_engine_compression_equals_codec_applied_directly():
    cfg = cfg_with("model.num_stages=2", "compression.forward=quant:3", "compression.backward=topk:0.3")
    pipeline, staged = build_local_pipeline(cfg, total_steps=10)
    ids, x, y = a_batch(cfg)
    metrics = run_one(pipeline, (ids, x, y))

    clone, _ = build_local_pipeline(cfg, total_steps=10)  # same seed, same weights
    first, second = (r.module for r in clone.runtimes)
    first.train()
    second.train()
    fwd, bwd = parse("quant:3"), parse("topk:0.3")
    h = first(x)
    h_wire = fwd.receiver().receive(wire.decode(fwd.sender().send(h.detach()).payload)).tensor.requires_grad_(True)
    loss = staged.loss(second(h_wire), y)
    loss.backward()
    g_wire = bwd.receiver().receive(wire.decode(bwd.sender().send(h_wire.grad).payload)).tensor
    h.backward(g_wire)
    assert math.isclose(metrics["loss"], float(loss.detach()), rel_tol=1e-6)
    for ours, theirs in zip(
        stage_grads(pipeline), [p.grad for m in (first, second) for p in m.parameters()], strict=True
    ):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_bytes_are_counted_per_link_and_direction():
    cfg = cfg_with("model.num_stages=3", "compression.forward=topk:0.2/fp16", "compression.backward=topk:reuse/fp16")
    pipeline, _ = build_local_pipeline(cfg, total_steps=10)
    ids, x, y = a_batch(cfg)
    run_one(pipeline, (ids, x, y))
    counted = pipeline.link_bytes()
    assert set(counted) == {f"boundary{b}.{d}.train" for b in (0, 1) for d in ("forward", "backward")}
    for b in (0, 1):  # reused indices: the gradient message is smaller than the activation message
        assert 0 < counted[f"boundary{b}.backward.train"] < counted[f"boundary{b}.forward.train"]


def test_eval_paths_compressed_and_uncompressed():
    cfg = cfg_with("model.num_stages=2", "compression.forward=topk:0.05", "compression.backward=topk:reuse")
    pipeline, staged = build_local_pipeline(cfg, total_steps=10)
    ids, x, y = a_batch(cfg, 32)
    exact = run_one(pipeline, (ids, x, y), Mode.EVAL, exact=True)
    compressed = run_one(pipeline, (ids, x, y), Mode.EVAL, exact=False)
    with torch.no_grad():
        staged.eval()
        h = staged.stages[0](x)
        plain = staged.metrics(staged.stages[1](h), y)
        spec = parse("topk:0.05")
        h_topk = spec.receiver().receive(wire.decode(spec.sender().send(h).payload)).tensor
        topk = staged.metrics(staged.stages[1](h_topk), y)
    assert math.isclose(exact["loss_sum"], float(plain["loss_sum"]), rel_tol=1e-5)
    assert math.isclose(compressed["loss_sum"], float(topk["loss_sum"]), rel_tol=1e-5)
    assert not math.isclose(exact["loss_sum"], compressed["loss_sum"], rel_tol=1e-3)
    assert pipeline.link_bytes()["boundary0.forward.eval"] > 0
    assert pipeline.state_bytes() == 0


def test_warmup_sends_exact_values_and_fills_aqsgd_buffers():
    cfg = cfg_with("model.num_stages=2", "compression.forward=topk:0.1+aqsgd/fp32", "compression.backward=topk:0.1")
    pipeline, _ = build_local_pipeline(cfg, total_steps=10)
    ids, x, y = a_batch(cfg, 8)
    run_one(pipeline, (ids, x, y), exact=True)
    warm = pipeline.link_bytes()["boundary0.forward.train"]
    sender = pipeline.ends[0].outbound.sender
    receiver = pipeline.ends[1].inbound.receiver
    state, versions = sender.table.load((8, *pipeline.runtimes[0].module(x).shape[1:]), ids.tolist(), "cpu")
    assert versions == (1,) * 8
    with torch.no_grad():
        h = pipeline.runtimes[0].module(x)
    assert torch.allclose(state, h, atol=1e-6)  # exact activations fill the buffers
    mirrored, _ = receiver.table.load(tuple(state.shape), ids.tolist(), "cpu")
    assert torch.equal(state, mirrored)
    run_one(pipeline, (ids, x, y), exact=False, index=1)
    compressed = pipeline.link_bytes()["boundary0.forward.train"] - warm
    assert compressed < warm / 3  # after warmup only the TopK delta travels


def test_the_in_process_transport_hands_the_runtimes_parsed_messages(monkeypatch):
    """As the swarm's stage peers do, the in-process transport parses every message's bytes at its
    edge: a runtime gets `Encoded` messages (stage 0's forward: the input tensor), never bytes."""
    cfg = cfg_with("model.num_stages=3", "compression.forward=quant:4", "compression.backward=topk:0.3")
    pipeline, _ = build_local_pipeline(cfg, total_steps=10)
    seen = []

    def spying(runtime, name):
        call = getattr(runtime, name)

        def spy(batch, payload, *rest):
            seen.append((runtime.index, name, type(payload)))
            return call(batch, payload, *rest)

        return spy

    for runtime in pipeline.runtimes:
        for name in ("forward", "backward"):
            monkeypatch.setattr(runtime, name, spying(runtime, name))
    ids, x, y = a_batch(cfg)
    run_one(pipeline, (ids, x, y))
    assert seen == [
        (0, "forward", torch.Tensor),
        (1, "forward", Encoded),
        (2, "forward", Encoded),
        (1, "backward", Encoded),
        (0, "backward", Encoded),
    ]


def test_messages_of_the_wrong_shape_are_refused_before_they_are_decoded(monkeypatch):
    cfg = cfg_with("model.num_stages=2", "compression.forward=quant:4", "compression.backward=quant:4")
    pipeline, _ = build_local_pipeline(cfg, total_steps=10)
    (first, second), (ends0, ends1) = pipeline.runtimes, pipeline.ends
    for end in (ends0.outbound, ends1.inbound):
        monkeypatch.setattr(end, "receive", lambda *args: pytest.fail("a message of the wrong shape was decoded"))
    ids, x, y = a_batch(cfg)
    batch = MicroBatch(0, 0, ids, y)
    sent = wire.decode(first.forward(batch, x, ends0).payload)
    short = parse("quant:4").sender().send(torch.zeros(sent.shape[0] - 1, *sent.shape[1:]))
    with pytest.raises(PayloadError, match=f"for {ids.numel()} samples$"):
        second.forward(batch, wire.decode(short.payload), ends1)
    wide = parse("quant:4").sender().send(torch.zeros(*sent.shape[:-1], sent.shape[-1] + 1))
    with pytest.raises(PayloadError, match="^micro-batch .*: gradient of shape"):
        first.backward(batch, wire.decode(wide.payload), {}, ends0)


def test_same_config_and_seed_give_the_same_losses(tmp_path):
    cfg = cfg_with("compression.forward=topk:0.2+ef21", "compression.backward=quant:6", "train.max_steps=6")
    first = run_experiment(cfg, tmp_path / "a.jsonl", progress=False)
    second = run_experiment(cfg, tmp_path / "b.jsonl", progress=False)
    from swarm.training.results import read_results

    losses = [
        [r["loss"] for r in read_results(p) if r["type"] == "step"]
        for p in (tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    ]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    assert first["bytes"] == second["bytes"]


def test_short_runs_reduce_the_loss(tmp_path):
    cfg = cfg_with("train.epochs=8", "optimizer.lr=0.1", "compression.forward=quant:4", "compression.backward=quant:8")
    summary = run_experiment(cfg, tmp_path / "r.jsonl", progress=False)
    from swarm.training.results import read_results

    steps = [r["loss"] for r in read_results(tmp_path / "r.jsonl") if r["type"] == "step"]
    assert sum(steps[-5:]) / 5 < 0.6 * sum(steps[:5]) / 5
    assert summary["final"]["compressed"]["accuracy"] > 0.5
    assert set(summary["bytes"]) == {f"boundary{b}.{d}" for b in range(3) for d in ("forward", "backward")}


def test_resnet_recipe_reduces_the_loss(tmp_path):
    cfg = cfg_with(
        "model.name=resnet18",
        "model.options={width: 4, in_channels: 3}",
        "data.options={train_size: 256, upscale: true}",
        "train.batch_size=32",
        "train.epochs=4",
        "train.micro_batches=2",
        "optimizer.lr=0.05",
        "compression.forward=topk:0.3",
        "compression.backward=topk:0.3",
        "train.eval_compressed=false",
    )
    run_experiment(cfg, tmp_path / "r.jsonl", progress=False)
    from swarm.training.results import read_results

    steps = [r["loss"] for r in read_results(tmp_path / "r.jsonl") if r["type"] == "step"]
    assert sum(steps[-4:]) / 4 < 0.8 * sum(steps[:4]) / 4


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    from _util import write_tiny_tokenizer

    root = tmp_path_factory.mktemp("text")
    words = "the cat sat on the mat and the dog ran to the hat . ".split()
    rows = [" = Title = \n"] + [
        " " + " ".join(words[(i * 3) % len(words) :] + words[: (i * 3) % len(words)]) + " \n" for i in range(60)
    ]
    (root / "wiki.train.raw").write_text("".join(rows))
    (root / "wiki.valid.raw").write_text("".join(rows[:12]))
    return root, write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def gpt2_cfg(text_dir, tokenizer, *more: str):
    return cfg_with(
        "name=tiny-gpt2",
        "model.name=gpt2",
        "model.options={config: {n_layer: 4, n_embd: 32, n_head: 2, n_positions: 32, vocab_size: 260, resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0}}",
        "data.name=wikitext2",
        f"data.data_dir={text_dir}",
        f"data.options={{tokenizer: '{tokenizer}', block_size: 16}}",
        "optimizer={name: adamw, lr: 0.003, weight_decay: 0.0, schedule: linear, grad_clip: 1.0}",
        "train.batch_size=8",
        "train.micro_batches=2",
        "train.eval_batch_size=8",
        *more,
    )


def test_gpt2_tied_embedding_stays_tied_and_matches_one_stage(tiny_text, tmp_path):
    from swarm.training.results import read_results

    text_dir, tokenizer = tiny_text
    cfg4 = gpt2_cfg(text_dir, tokenizer, "train.max_steps=5", "compression.forward=none", "compression.backward=none")
    cfg1 = gpt2_cfg(
        text_dir,
        tokenizer,
        "train.max_steps=5",
        "model.num_stages=1",
        "compression.forward=none",
        "compression.backward=none",
    )
    run_experiment(cfg4, tmp_path / "four.jsonl", progress=False)
    run_experiment(cfg1, tmp_path / "one.jsonl", progress=False)
    four = [r["loss"] for r in read_results(tmp_path / "four.jsonl") if r["type"] == "step"]
    one = [r["loss"] for r in read_results(tmp_path / "one.jsonl") if r["type"] == "step"]
    assert len(four) == 5
    for a, b in zip(four, one, strict=True):  # the tie is kept: 4 stages train exactly like 1
        assert math.isclose(a, b, rel_tol=1e-5)

    pipeline, staged = build_local_pipeline(cfg4, total_steps=10)
    assert staged.tied, "GPT-2 split over 4 stages must list the tied embedding"
    ids, x, y = a_batch(cfg4, 4)
    run_one(pipeline, (ids, x, y))
    pipeline.step()
    assert tied_weight_drift(staged.stages, staged.tied) == 0.0


@pytest.mark.parametrize(
    ("forward", "backward"),
    [
        ("topk:0.3", "topk:reuse"),
        ("lowrank:4+ef21", "lowrank:4+ef"),  # [batch, tokens, hidden] as a rank-4 message per micro-batch
    ],
)
def test_gpt2_recipe_reduces_the_loss(tiny_text, tmp_path, forward, backward):
    from swarm.training.results import read_results

    text_dir, tokenizer = tiny_text
    cfg = gpt2_cfg(
        text_dir, tokenizer, "train.epochs=6", f"compression.forward={forward}", f"compression.backward={backward}"
    )
    summary = run_experiment(cfg, tmp_path / "g.jsonl", progress=False)
    steps = [r["loss"] for r in read_results(tmp_path / "g.jsonl") if r["type"] == "step"]
    assert sum(steps[-3:]) / 3 < 0.8 * sum(steps[:3]) / 3
    assert "perplexity" in summary["final"]["uncompressed"]


def test_micro_batch_split_gives_the_asked_count_and_weights_sum_to_one():
    from swarm.training.loop import split_micro_batches

    ids = torch.arange(6)
    parts = split_micro_batches(0, ids, torch.randn(6, 3), torch.zeros(6), 4, Mode.TRAIN, False)
    assert [b.size for b, _ in parts] == [2, 2, 1, 1]
    assert math.isclose(sum(b.weight for b, _ in parts), 1.0)
    assert torch.equal(torch.cat([b.sample_ids for b, _ in parts]), ids)


@pytest.mark.parametrize(
    ("forward", "backward"),
    [("lowrank:4", "lowrank:4"), ("lowrank:4/q8+ef21", "lowrank:2+ef"), ("subspace:4/every4", "subspace:2+ef")],
)
def test_smoke_trains_with_low_rank_both_ways(tmp_path, forward, backward):
    """The CNN's 4-D boundaries as [batch*channels*height, width] matrices: fewer bytes than
    uncompressed on every link, finite losses, and evaluations through the compressed links."""
    from swarm.training.results import read_results

    runs = {}
    for name, specs in {"none": ("none", "none"), "lowrank": (forward, backward)}.items():
        cfg = cfg_with(f"compression.forward={specs[0]}", f"compression.backward={specs[1]}", "train.max_steps=4")
        summary = run_experiment(cfg, tmp_path / f"{name}.jsonl", progress=False)
        runs[name] = (summary, [r["loss"] for r in read_results(tmp_path / f"{name}.jsonl") if r["type"] == "step"])
    (dense, _), (low, losses) = runs["none"], runs["lowrank"]
    assert len(losses) == dense["steps"] == low["steps"] and all(math.isfinite(x) for x in losses)
    assert set(low["bytes"]) == set(dense["bytes"])
    assert all(low["bytes"][link] < 0.8 * dense["bytes"][link] for link in dense["bytes"]), low["bytes"]
    assert math.isfinite(low["final"]["compressed"]["loss"])
