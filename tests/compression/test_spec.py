"""swarm.compression.spec: the spec grammar."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import wire
from protocols.message import Granularity
from swarm.cli import main
from swarm.compression import Cast, CompressionSpec, Quantize, SpecError, TopK, TopKReuse, parse
from swarm.compression.feedback import ErrorFeedbackSender, MirroredReceiver, MirroredSender
from swarm.compression.lowrank import LowRank
from swarm.compression.subspace import Subspace
from swarm.config import ConfigError, load_config

G = Granularity

VALID = {
    "none": (Cast(), None, False, None),
    "fp32": (Cast(torch.float32), None, False, None),
    "fp16": (Cast(torch.float16), None, False, None),
    "bf16": (Cast(torch.bfloat16), None, False, None),
    "quant:1": (Quantize(1, G.SAMPLE), None, False, None),
    "quant:8": (Quantize(8, G.SAMPLE), None, False, None),
    "quant:4/tensor": (Quantize(4, G.TENSOR), None, False, None),
    "quant:4/sample": (Quantize(4, G.SAMPLE), None, False, None),
    "quant:4/channel": (Quantize(4, G.CHANNEL), None, False, None),
    "quant:4/stochastic": (Quantize(4, G.SAMPLE, True), None, False, None),
    "quant:3/channel/stochastic": (Quantize(3, G.CHANNEL, True), None, False, None),
    "topk:0.1": (TopK(0.1), None, False, None),
    "topk:1": (TopK(1.0), None, False, None),
    "topk:0.1/fp16": (TopK(0.1, Cast(torch.float16)), None, False, None),
    "topk:0.1/bf16": (TopK(0.1, Cast(torch.bfloat16)), None, False, None),
    "topk:0.1/fp32": (TopK(0.1, Cast(torch.float32)), None, False, None),
    "topk:0.1/q8": (TopK(0.1, Quantize(8, G.SAMPLE)), None, False, None),
    "topk:0.05/q4/stochastic": (TopK(0.05, Quantize(4, G.SAMPLE, True)), None, False, None),
    "topk:reuse": (TopKReuse(), None, False, None),
    "topk:reuse/fp16": (TopKReuse(Cast(torch.float16)), None, False, None),
    "topk:reuse/q4": (TopKReuse(Quantize(4, G.SAMPLE)), None, False, None),
    "topk:0.1+ef": (TopK(0.1), "ef", False, None),
    "quant:2+ef/sample": (Quantize(2, G.SAMPLE), "ef", True, None),
    "topk:0.1+efmixed": (TopK(0.1), "efmixed", False, None),
    "topk:0.1+efmixed/sample": (TopK(0.1), "efmixed", True, None),
    "topk:0.1+ef21": (TopK(0.1), "ef21", False, None),
    "topk:0.1+ef21/sample": (TopK(0.1), "ef21", True, None),
    "topk:reuse/fp16+ef21": (TopKReuse(Cast(torch.float16)), "ef21", False, None),
    "topk:0.3+aqsgd": (TopK(0.3), "aqsgd", True, "q6"),
    "topk:0.3+aqsgd/fp16": (TopK(0.3), "aqsgd", True, "fp16"),
    "topk:0.3+aqsgd/fp32": (TopK(0.3), "aqsgd", True, "fp32"),
    "quant:4+aqsgd/q4": (Quantize(4, G.SAMPLE), "aqsgd", True, "q4"),
    "fp16+aqsgd/bf16": (Cast(torch.float16), "aqsgd", True, "bf16"),
    "  TopK:0.1/FP16+EF21  ": (TopK(0.1, Cast(torch.float16)), "ef21", False, None),
    "lowrank:8": (LowRank(8), None, False, None),
    "lowrank:1/fp16": (LowRank(1), None, False, None),
    "lowrank:32/q8": (LowRank(32, Quantize(8, G.SAMPLE)), None, False, None),
    "lowrank:4/q4": (LowRank(4, Quantize(4, G.SAMPLE)), None, False, None),
    "lowrank:16/bf16": (LowRank(16, Cast(torch.bfloat16)), None, False, None),
    "lowrank:16/fp32": (LowRank(16, Cast(torch.float32)), None, False, None),
    "lowrank:8+ef": (LowRank(8), "ef", False, None),
    "lowrank:8/q8+ef21": (LowRank(8, Quantize(8, G.SAMPLE)), "ef21", False, None),
    "lowrank:4+ef21/sample": (LowRank(4), "ef21", True, None),
    "lowrank:4+aqsgd/fp16": (LowRank(4), "aqsgd", True, "fp16"),
    "lowrank:8/warm": (LowRank(8, warm=True), None, False, None),
    "lowrank:8/fp16/warm": (LowRank(8, warm=True), None, False, None),
    "lowrank:32/q8/warm": (LowRank(32, Quantize(8, G.SAMPLE), True), None, False, None),
    "lowrank:16/fp32/warm+ef": (LowRank(16, Cast(torch.float32), True), "ef", False, None),
    "lowrank:8/q8/warm+ef21": (LowRank(8, Quantize(8, G.SAMPLE), True), "ef21", False, None),
    "lowrank:4/warm+ef21/sample": (LowRank(4, warm=True), "ef21", True, None),
    "lowrank:4/bf16/warm+aqsgd/q6": (LowRank(4, Cast(torch.bfloat16), True), "aqsgd", True, "q6"),
    "subspace:8": (Subspace(8), None, False, None),
    "subspace:1/fp16": (Subspace(1), None, False, None),
    "subspace:8/q8": (Subspace(8, Quantize(8, G.SAMPLE)), None, False, None),
    "subspace:4/bf16/every16": (Subspace(4, Cast(torch.bfloat16), 16), None, False, None),
    "subspace:4/every1": (Subspace(4, every=1), None, False, None),
    "subspace:16/fp32/every32": (Subspace(16, Cast(torch.float32)), None, False, None),
    "subspace:8/q4+ef": (Subspace(8, Quantize(4, G.SAMPLE)), "ef", False, None),
    "subspace:8+ef/sample": (Subspace(8), "ef", True, None),
}


def carry(spec: CompressionSpec) -> torch.Tensor:
    """A micro-batch through a link of this spec (a forward TopK selection for topk:reuse): what arrives."""
    x = torch.randn(2, 20)
    ids = [0, 1]
    reuse = parse("topk:0.25").sender().send(x).selection if spec.reuses_indices else None
    out = spec.sender().send(x, sample_ids=ids, reuse=reuse)
    received = spec.receiver().receive(wire.decode(out.payload), sample_ids=ids, reuse=reuse).tensor
    assert received.shape == x.shape and received.dtype == x.dtype
    return received


@pytest.mark.parametrize("text", list(VALID))
def test_valid_forms(text):
    codec, feedback, per_sample, store = VALID[text]
    spec = parse(text)
    assert spec.codec == codec
    assert spec.feedback == feedback
    assert spec.per_sample == per_sample
    if store is not None:
        assert spec.store == store
    assert spec.mirrored == (feedback in ("ef21", "aqsgd"))
    assert spec.reuses_indices == isinstance(codec, TopKReuse)
    sender, receiver = spec.sender(), spec.receiver()
    if spec.mirrored:
        assert isinstance(sender, MirroredSender) and isinstance(receiver, MirroredReceiver)
    elif feedback:
        assert isinstance(sender, ErrorFeedbackSender)
    carry(spec)


@pytest.mark.parametrize("text", [t for t in VALID if "+" not in t and "reuse" not in t])
def test_codec_spec_string_parses_back(text):
    codec = parse(text).codec
    assert parse(codec.spec).codec == codec


TYPOS = [
    "",
    "   ",
    "topk",
    "topk:",
    "topk:abc",
    "topk:0",
    "topk:0.0",
    "topk:1.5",
    "topk:-0.1",
    "topk:nan",
    "topk:inf",
    "topk:0.1/fp8",
    "topk:0.1/q9",
    "topk:0.1/q0",
    "topk:0.1/q",
    "topk:0.1/q4/fp16",
    "topk:0.1/",
    "topk:reuse/q4/fp16",
    "topk0.1",
    "top-k:0.1",
    "quant",
    "quant:",
    "quant:0",
    "quant:9",
    "quant:16",
    "quant:x",
    "quant:4/channels",
    "quant:4/",
    "quant:4/fp16",
    "fp61",
    "float16",
    "fp16+",
    "fp16+ef22",
    "fp16+ef21/samples",
    "topk:0.1+ef/samples",
    "topk:0.1+ef/fp16",
    "topk:0.1+aqsgd/q9",
    "topk:0.1+aqsgd/fp8",
    "topk:0.1+aqsgd/q",
    "fp16+efmixed",
    "quant:4+efmixed",
    "topk:reuse+efmixed",
    "quant:4+ef21/global",
    "topk:0.1+ef21+ef",
    "topk:0.1++ef",
    "+ef21",
    "lowrank",
    "lowrank:",
    "lowrank:0",
    "lowrank:-1",
    "lowrank:08",
    "lowrank:1.5",
    "lowrank:x",
    "lowrank:1000000",
    "lowrank:8/",
    "lowrank:8/none",
    "lowrank:8/fp8",
    "lowrank:8/q9",
    "lowrank:8/q8/stochastic",
    "lowrank:8/q8/fp16",
    "lowrank:8/tensor",
    "lowrank:8+efmixed",
    "lowrank:warm",
    "lowrank:8/warm/q8",
    "lowrank:8/warm/warm",
    "lowrank:8/warm/",
    "lowrank:8/warm8",
    "lowrank:8/cold",
    "lowrank:8/q8/stochastic/warm",
    "lowrank:8/warm+efmixed",
    "subspace:8/warm",
    "low-rank:8",
    "subspace",
    "subspace:",
    "subspace:0",
    "subspace:08",
    "subspace:2.5",
    "subspace:8/",
    "subspace:8/fp8",
    "subspace:8/q0",
    "subspace:8/q8/stochastic",
    "subspace:8/every0",
    "subspace:8/every",
    "subspace:8/every-1",
    "subspace:8/every1000000",
    "subspace:8/every32/q8",
    "subspace:8/every8/every8",
    "subspace:8/q8/fp16",
    "subspace:8+ef21",
    "subspace:8+ef21/sample",
    "subspace:8+aqsgd",
    "subspace:8/q8+aqsgd/fp16",
    "subspace:8+efmixed",
]


@pytest.mark.parametrize("text", TYPOS)
def test_typos_raise_spec_error(text):
    with pytest.raises(SpecError) as info:
        parse(text)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message
    for form in ("quant:BITS", "topk:RATIO", "topk:reuse", "lowrank:RANK", "subspace:RANK", "ef21", "aqsgd", "fp16"):
        assert form in message, form
    assert repr(text) in message or text.strip() in message


@pytest.mark.parametrize("text", ["topk:5\n/fp16", "topk:2\n+ef21", "quant:4\n/x", "topk:0.1+aqsgd/q9\nx"])
def test_error_message_is_one_line_even_for_multiline_input(text):
    with pytest.raises(SpecError) as info:
        parse(text)
    assert "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("value", [None, 3, 0.1, b"topk:0.1", ["topk:0.1"]])
def test_non_string_spec(value):
    with pytest.raises(SpecError):
        parse(value)


TOKENS = [
    "none",
    "fp32",
    "fp16",
    "bf16",
    "quant",
    "topk",
    "reuse",
    "lowrank",
    "subspace",
    "every8",
    "warm",
    ":",
    "/",
    "+",
    "0.1",
    "1",
    "4",
    "9",
    "q4",
    "q9",
    "tensor",
    "sample",
    "channel",
    "stochastic",
    "ef",
    "ef21",
    "efmixed",
    "aqsgd",
    " ",
    "\n",
    "\t",
    "x",
    "-",
    ".",
]


@settings(max_examples=300)
@given(st.lists(st.sampled_from(TOKENS), max_size=8))
def test_parse_fuzz_only_spec_errors(tokens):
    """Any text is either a one-line SpecError or a spec that parses again to itself and makes a
    working link."""
    text = "".join(tokens)
    try:
        spec = parse(text)
    except SpecError as e:
        assert "\n" not in str(e), repr(str(e))
        return
    assert parse(spec.text) == spec
    assert parse(spec.codec.spec).codec == spec.codec
    carry(spec)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("compression.forward=topk:2", "compression.forward"),
        ("compression.backward=quant:9", "compression.backward"),
        ("compression.boundaries={1: {forward: 'topk:0.1+ef22'}}", "compression.boundaries.1.forward"),
    ],
)
def test_a_bad_spec_in_a_config_is_one_line_naming_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert message.startswith(f"{field}: bad compression spec ") and "valid forms: " in message, message
    assert "\n" not in message


def test_the_cli_reports_a_bad_spec_in_one_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("compression: {forward: 'topk:0.1', backward: 'quant:9'}\n")
    assert main(["run", str(config), "--set", "compression.forward=topk:abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: compression.forward: bad compression spec 'topk:abc'") and err.count("\n") == 1
    assert main(["run", str(config)]) == 2
    assert capsys.readouterr().err.startswith("error: compression.backward: bad compression spec 'quant:9'")
    # outside a config (the benchmark's codec list) a SpecError is caught as the ValueError it is
    assert main(["bench", "throughput", "--codecs", "none,topk:2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad compression spec 'topk:2'") and err.count("\n") == 1
