"""Helpers shared by the test modules (not a test module itself)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from protocols import compressed_tensor_pb2 as pb
from protocols.framing import frame_parts
from swarm.engine.step import tie

REPO = Path(__file__).resolve().parents[1]  # the checkout the tests run in
SMOKE = REPO / "configs" / "smoke.yaml"  # a 4-stage digits pipeline that runs in seconds


def cli_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`python -m swarm ARGS` run in this process, as a finished process would report it: for a
    refusal or a short command a new interpreter would cost seconds of imports."""
    from swarm.cli.main import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def refusal(capsys, *args: str) -> str:
    """The one line `python -m swarm ARGS` (in this process) refuses with, after exiting with 2."""
    capsys.readouterr()  # what came before is not this command's
    done = cli_here(capsys, *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def one_line_error(match: str, build, *args, **kwargs) -> str:
    """The message of the ValueError `build(*args, **kwargs)` raises: it matches `match`, in one line."""
    with pytest.raises(ValueError, match=match) as info:
        build(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def apt_install(package: str, hint: str) -> None:
    """`apt-get update` then `apt-get install PACKAGE` (as root): a fresh machine has no package
    lists, so an install alone fails there. Raises RuntimeError, in one line with `hint`, on failure."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"{package} is missing and installing it needs root and apt-get; {hint}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]
    for cmd in (["apt-get", "update", "-qq"], install):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({exc}); {hint}") from None
        if proc.returncode:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode} ({last}); {hint}")


def ensure_iptables() -> None:
    """iptables for the lab's NAT routers (swarm.netlab.nat), installed if missing."""
    if shutil.which("iptables") is None:
        apt_install("iptables", "install it by hand: sudo apt-get install -y iptables")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def make(shape, dtype=torch.float32, layout="contiguous", scale=1.0, gen=None):
    """A random tensor of `shape` and `dtype`; `layout` picks a non-contiguous variant.

    - "contiguous": plain
    - "transposed": the transpose of a contiguous tensor (last two dims swapped)
    - "strided": every other element of a twice-as-long last dim
    - "permuted": for 4-D, a permuted view
    """
    shape = tuple(shape)
    if layout == "contiguous" or len(shape) == 0:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if layout == "transposed":
        assert len(shape) >= 2
        base = torch.randn((*shape[:-2], shape[-1], shape[-2]), generator=gen, dtype=torch.float64) * scale
        x = base.to(dtype).transpose(-1, -2)
    elif layout == "strided":
        base = torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen, dtype=torch.float64) * scale
        x = base.to(dtype)[..., ::2]
    elif layout == "permuted":
        assert len(shape) == 4
        b, c, h, w = shape
        x = (torch.randn((b, h, w, c), generator=gen, dtype=torch.float64) * scale).to(dtype).permute(0, 3, 1, 2)
    else:
        raise ValueError(layout)
    assert tuple(x.shape) == shape
    if x.numel() > 1:
        assert not x.is_contiguous()
    return x


def buffers_of(msg: pb.CompressedTensor) -> list[bytes]:
    """Every buffer field of a message, in schema order (what buffer_length counts)."""

    def quant(q):
        return [q.codes, q.lows, q.steps]

    def values(m, oneof: str):
        which = m.WhichOneof(oneof)
        if which is None:
            return []
        part = getattr(m, which)
        return quant(part) if which.startswith("quantized") else [part.data]

    which = msg.WhichOneof("body")
    if which == "raw":
        return [msg.raw.data]
    if which == "quantized":
        return quant(msg.quantized)
    if which == "sparse":
        return [msg.sparse.indices, *values(msg.sparse, "values")]
    if which == "low_rank":
        return [*values(msg.low_rank, "left"), *values(msg.low_rank, "right")]
    if which == "subspace":
        return [*values(msg.subspace, "coefficients"), *values(msg.subspace, "basis")]
    return []


def seal(msg: pb.CompressedTensor) -> bytes:
    """Recompute buffer_length and checksum so a hand-made message passes the integrity check:
    the checksum is the crc32 of the serialized message without it, appended as field 15."""
    msg.buffer_length = sum(len(b) for b in buffers_of(msg))
    msg.ClearField("checksum")
    body = msg.SerializeToString()
    msg.checksum = zlib.crc32(body)
    return body + bytes([(15 << 3) | 5]) + msg.checksum.to_bytes(4, "little")


def parse_pb(payload: bytes) -> pb.CompressedTensor:
    msg = pb.CompressedTensor()
    msg.ParseFromString(payload)
    return msg


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def numel(shape) -> int:
    return math.prod(shape)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def write_tiny_tokenizer(root):
    """A tiny byte-level BPE in GPT-2's file format (256 bytes, three merges, <|endoftext|>), with
    the tokenizer_config.json save_pretrained writes (AutoTokenizer needs it to pick the class)."""
    import json

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = ["Ġ t", "h e", "Ġt he"]
    for merge in merges:
        vocab[merge.replace(" ", "")] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return root


# ---- tied parameters of a model split into stages (swarm.models.TiedPair) ------------------------


def tied_params(stages, pair) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """The two copies of a tied parameter; ValueError naming the one that is not there."""
    found = []
    for stage_index, name in (pair.first, pair.second):
        params = dict(stages[stage_index].named_parameters())
        if name not in params:
            raise ValueError(f"tied parameter {name!r} is not a parameter of stage {stage_index}")
        found.append(params[name])
    return found[0], found[1]


def sync_tied(stages, tied) -> None:
    """Both copies of every tied parameter get the sum of their gradients, by the engine's own
    `tie` (what a pipeline's step does before the optimizer steps)."""
    gathered: dict = {}
    for pair in tied:
        for (stage, name), param in zip((pair.first, pair.second), tied_params(stages, pair), strict=True):
            if param.grad is not None:
                gathered.setdefault(stage, {})[name] = param.grad
    grads: dict = {}
    tie(gathered, tied, grads)
    for stage, named in grads.items():
        for name, grad in named.items():
            param = stages[stage].get_parameter(name)
            param.grad = grad.to(param.device, param.dtype, copy=True)


def tied_weight_drift(stages, tied) -> float:
    """Largest absolute difference between the copies of tied parameters (0.0 when in sync)."""
    drift = 0.0
    for pair in tied:
        a, b = tied_params(stages, pair)
        drift = max(drift, float((a.detach() - b.detach().to(a.device)).abs().max()))
    return drift


def frame(message_type, head_field: str, head, payload: bytes) -> list:
    """`framing.frame_parts` as protobuf messages: what a test may alter before sending them as they are."""
    return [message_type.FromString(b"".join(parts)) for parts in frame_parts(message_type, head_field, head, payload)]


# ---- tiny random configs of the transformers decoder families the tests check -----------------------

TINY_VOCAB = 97
_DECODER_SIZES = dict(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4)
_DECODER_COMMON = dict(_DECODER_SIZES, intermediate_size=64)
TINY_DECODERS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, max_position_embeddings=64, **_DECODER_COMMON),
    # a window shorter than the sequence: the sliding-window mask matters
    "mistral": dict(
        model_type="mistral", num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, **_DECODER_COMMON
    ),
    "qwen2": dict(
        model_type="qwen2",
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        **_DECODER_COMMON,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox", max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, **_DECODER_COMMON
    ),
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=TINY_VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    # ALiBi positions: each stage rebuilds the bias; a layer norm right after the embedding
    "bloom": dict(model_type="bloom", vocab_size=TINY_VOCAB, hidden_size=32, n_layer=4, n_head=4),
    # Falcon-7B's shape (multi-query attention, attention and MLP in parallel, rotary positions);
    # its layers take an `alibi` argument, None without ALiBi
    "falcon": dict(
        model_type="falcon", vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4
    ),
    # sliding and full layers alternating, soft-capped attention, and logits soft-capped after the
    # head by a cap small enough for a random model's logits to feel it
    "gemma2": dict(
        model_type="gemma2",
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        final_logit_softcapping=0.5,
        **_DECODER_COMMON,
    ),
    # rotary cos/sin of its own per layer type (local and global bases)
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=0.5,
        **_DECODER_COMMON,
    ),
    # its pieces under model.decoder, learned positions two rows into their table, an embedding
    # narrower than the layers (projected in and out), the head tied to the embedding
    "opt": dict(
        model_type="opt", word_embed_proj_dim=16, ffn_dim=64, max_position_embeddings=64, dropout=0.0, **_DECODER_SIZES
    ),
    "cohere": dict(model_type="cohere", num_key_value_heads=2, logit_scale=4.0, **_DECODER_COMMON),  # logits scaled up
    # logits scaled down; embeddings scaled up in the base model's forward (Granite 3's 12)
    "granite": dict(
        model_type="granite", num_key_value_heads=2, logits_scaling=0.25, embedding_multiplier=12.0, **_DECODER_COMMON
    ),
}
