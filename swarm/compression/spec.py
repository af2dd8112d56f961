"""The compression spec grammar used by configs and the CLI.

    spec      := codec [ "+" feedback ]
    codec     := "none" | "fp32" | "fp16" | "bf16"
               | "quant:" BITS { "/" ("tensor" | "sample" | "channel" | "stochastic") }
               | "topk:" RATIO { "/" value }          RATIO in (0, 1]
               | "topk:reuse" { "/" value }            backward only: the forward's indices
               | "lowrank:" RANK [ "/" factor ] [ "/warm" ]   RANK >= 1; factors fp16 by default
               | "subspace:" RANK [ "/" factor ] [ "/every" K ]   coefficients fp16, K = 32 by default
    value     := "fp32" | "fp16" | "bf16" | "q" BITS [ "/stochastic" ]    (TopK values)
    factor    := "fp32" | "fp16" | "bf16" | "q" BITS      (low-rank factors, subspace coefficients)
    feedback  := ("ef" | "ef21" | "efmixed") [ "/sample" ] | "aqsgd" [ "/" STORE ]
    STORE     := "fp32" | "fp16" | "bf16" | "q1".."q8"      (AQ-SGD buffer format, default q6)

Examples: `topk:0.1`, `quant:4`, `quant:4/tensor`, `topk:0.1/fp16`, `topk:0.1/q8`,
`topk:0.1+ef21`, `topk:0.3+aqsgd/fp16`, `topk:reuse`, `lowrank:8`, `lowrank:32/q8+ef21`,
`lowrank:32/q8/warm+ef21`, `subspace:8`, `subspace:8/q8/every16+ef`. `/warm` starts a low-rank
link's sender from the directions of its last delivered message (`swarm.compression.warm`):
state on the sender only, in plain low-rank messages, so it takes any feedback plain lowrank
takes. A subspace codec keeps mirrored link state of its own (the basis), so it takes only
sender-side feedback (`+ef`): EF21 or AQ-SGD would put a second mirrored state, with its own
versions and warmup, in the same messages.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from protocols.message import Granularity
from swarm.compression.basis import LinkSubspace
from swarm.compression.codecs import Cast, Codec, Quantize, TopK, TopKReuse
from swarm.compression.feedback import ErrorFeedbackSender, MirroredReceiver, MirroredSender, Receiver, Sender
from swarm.compression.lowrank import FP16, LowRank
from swarm.compression.state import STORE_FORMATS, check_store_format
from swarm.compression.subspace import DEFAULT_EVERY, Subspace
from swarm.compression.warm import WarmLowRank

VALID_FORMS = (
    "none | fp32 | fp16 | bf16 | quant:BITS[/tensor|/sample|/channel][/stochastic] | "
    "topk:RATIO[/fp32|/fp16|/bf16|/qBITS] | topk:reuse[/...] | lowrank:RANK[/fp16|/bf16|/fp32|/qBITS][/warm] | "
    "subspace:RANK[/fp16|/bf16|/fp32|/qBITS][/everyK]; "
    "optionally +ef | +ef21 | +efmixed (each [/sample]) | +aqsgd[/STORE] (subspace: +ef only)"
)
DEFAULT_STORE = "q6"  # AQ-SGD buffers: 6-bit codes, under a quarter of an fp32 copy
_CASTS = {"none": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class SpecError(ValueError):
    """A compression spec that does not parse; the message lists the valid forms."""

    def __init__(self, spec: str, why: str) -> None:
        super().__init__(f"bad compression spec {spec!r}: {why}; valid forms: {VALID_FORMS}")


@dataclass(frozen=True)
class CompressionSpec:
    text: str
    codec: Codec
    feedback: str | None = None  # "ef", "efmixed", "ef21", "aqsgd"
    per_sample: bool = False
    store: str = "fp32"

    @property
    def mirrored(self) -> bool:
        return self.feedback in ("ef21", "aqsgd")

    @property
    def keeps_state(self) -> bool:
        """Whether messages change state kept across micro-batches: error feedback, a subspace
        basis, a low-rank warm start."""
        return self.feedback is not None or isinstance(self.codec, Subspace) or self._warm

    @property
    def _warm(self) -> bool:
        return isinstance(self.codec, LowRank) and self.codec.warm

    @property
    def reuses_indices(self) -> bool:
        return isinstance(self.codec, TopKReuse)

    def _end_codec(self, sending: bool) -> Codec:
        """The codec one link end runs: a subspace codec with that end's own basis; a warm
        low-rank sender with its own start (its receiver decodes plain low-rank messages)."""
        if isinstance(self.codec, Subspace):
            return LinkSubspace(self.codec)
        if sending and self._warm:
            return WarmLowRank(self.codec)
        return self.codec

    def sender(self, store_path=None, capacity: int | None = None) -> Sender:
        codec = self._end_codec(sending=True)
        if self.feedback in ("ef", "efmixed"):
            return ErrorFeedbackSender(
                codec, self.per_sample, self.feedback == "efmixed", self.store, store_path, capacity
            )
        if self.mirrored:
            return MirroredSender(codec, self.per_sample, self.store, store_path, capacity)
        return Sender(codec)

    def receiver(self, store_path=None, capacity: int | None = None) -> Receiver:
        codec = self._end_codec(sending=False)
        if self.mirrored:
            return MirroredReceiver(codec, self.per_sample, self.store, store_path, capacity)
        return Receiver(codec)


def _bits(text: str, spec: str) -> int:
    if not re.fullmatch(r"[1-8]", text):
        raise SpecError(spec, f"bits must be 1..8, got {text!r}")
    return int(text)


def _value_codec(options: list[str], spec: str) -> Cast | Quantize:
    if not options:
        return Cast()
    head, rest = options[0], options[1:]
    if head in _CASTS and not rest:
        return Cast(_CASTS[head])
    if head.startswith("q") and rest in ([], ["stochastic"]):
        return Quantize(_bits(head[1:], spec), Granularity.SAMPLE, stochastic=bool(rest))
    raise SpecError(spec, f"unknown TopK value format {'/'.join(options)!r}")


def _count(text: str, spec: str, what: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]{0,5}", text):
        raise SpecError(spec, f"{what} must be an integer in 1..999999, got {text!r}")
    return int(text)


def _factors(options: list[str], spec: str, what: str) -> Cast | Quantize:
    """The format of low-rank factors or subspace coefficients: fp16 (default), fp32, bf16 or qBITS."""
    if options in ([], ["fp16"]):
        return FP16
    if options in (["fp32"], ["bf16"]):
        return Cast(_CASTS[options[0]])
    if len(options) == 1 and options[0].startswith("q"):
        return Quantize(_bits(options[0][1:], spec), Granularity.SAMPLE)
    raise SpecError(spec, f"unknown {what} format {'/'.join(options)!r}")


def _low_rank(parts: list[str], spec: str) -> LowRank:
    options = parts[1:]
    warm = options[-1:] == ["warm"]  # last, as subspace's /everyK: the factor format comes first
    if warm:
        options = options[:-1]
    return LowRank(_count(parts[0], spec, "low rank"), _factors(options, spec, "low-rank factor"), warm)


def _subspace(parts: list[str], spec: str) -> Subspace:
    rank = _count(parts[0], spec, "subspace rank")
    options, every = parts[1:], DEFAULT_EVERY
    if options and options[-1].startswith("every"):
        every = _count(options[-1].removeprefix("every"), spec, "subspace refresh interval every")
        options = options[:-1]
    return Subspace(rank, _factors(options, spec, "subspace coefficient"), every)


def _quant(arg: str, options: list[str], spec: str) -> Quantize:
    granularity = Granularity.SAMPLE
    stochastic = False
    for opt in options:
        if opt in ("tensor", "sample", "channel"):
            granularity = Granularity(opt)
        elif opt == "stochastic":
            stochastic = True
        else:
            raise SpecError(spec, f"unknown quantization option {opt!r}")
    return Quantize(_bits(arg, spec), granularity, stochastic)


def _codec(text: str, spec: str) -> Codec:
    name, colon, rest = text.partition(":")
    parts = rest.split("/") if rest else []
    if name in _CASTS and not colon:
        return Cast(_CASTS[name])
    if name == "quant" and parts:
        return _quant(parts[0], parts[1:], spec)
    if name == "topk" and parts:
        if parts[0] == "reuse":
            return TopKReuse(_value_codec(parts[1:], spec))
        try:
            ratio = float(parts[0])
        except ValueError:
            raise SpecError(spec, f"TopK ratio must be a number in (0, 1], got {parts[0]!r}") from None
        if not 0.0 < ratio <= 1.0:
            raise SpecError(spec, f"TopK ratio must be in (0, 1], got {parts[0]!r}")
        return TopK(ratio, _value_codec(parts[1:], spec))
    if name == "lowrank" and parts:
        return _low_rank(parts, spec)
    if name == "subspace" and parts:
        return _subspace(parts, spec)
    raise SpecError(spec, f"unknown codec {text!r}")


@functools.cache
def keeps_state(*specs: str) -> bool:
    """Whether any of these codec specs keeps state across micro-batches (error feedback, AQ-SGD,
    a subspace basis, a low-rank warm start; cached: a stage asks it per micro-batch)."""
    return any(parse(spec).keeps_state for spec in specs)


def parse(spec: str) -> CompressionSpec:
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(str(spec), "empty spec")
    text = spec.strip().lower()
    if any(c.isspace() or not c.isprintable() for c in text):
        raise SpecError(spec, "a spec has no spaces or control characters")
    if any(not piece for piece in text.replace("+", "/").split("/")):
        raise SpecError(spec, "empty part (a stray '/' or '+')")
    codec_text, plus, feedback_text = text.partition("+")
    codec = _codec(codec_text, spec)
    if not plus:
        return CompressionSpec(text, codec)
    name, _, option = feedback_text.partition("/")
    if isinstance(codec, Subspace) and name in ("ef21", "aqsgd"):
        raise SpecError(spec, f"a subspace codec keeps its basis mirrored already: it takes +ef, not +{name}")
    if name in ("ef", "ef21", "efmixed"):
        if option not in ("", "sample"):
            raise SpecError(spec, f"{name} takes only /sample, got {option!r}")
        if name == "efmixed" and not isinstance(codec, TopK):
            raise SpecError(spec, "efmixed works with a topk:RATIO codec")
        return CompressionSpec(text, codec, name, per_sample=option == "sample")
    if name == "aqsgd":
        try:
            store = check_store_format(option or DEFAULT_STORE)
        except ValueError:
            raise SpecError(spec, f"unknown AQ-SGD store {option!r} (use {STORE_FORMATS})") from None
        return CompressionSpec(text, codec, "aqsgd", per_sample=True, store=store)
    raise SpecError(spec, f"unknown error feedback {feedback_text!r}")
