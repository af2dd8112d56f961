"""What every model builder returns: stages, a loss, summable metrics, and tied parameters.

A model is built whole under the caller's seed and then cut into stages, so the number of
stages never changes the initial weights and the composed stages compute exactly what the
unsplit model computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.sampling import is_sample_request, picked_tokens, request_problem

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


@dataclass(frozen=True)
class TiedPair:
    """One parameter held by two stages (each its own copy), e.g. GPT-2's wte and lm_head."""

    first: tuple[int, str]  # (stage index, name in that stage's named_parameters())
    second: tuple[int, str]


INDEX_DTYPES = (torch.int64, torch.uint8)  # what cross entropy takes as class indices


@dataclass(frozen=True)
class Targets:
    """What a model's loss takes as targets, so that a stage peer refuses others where it decodes
    a micro-batch, as its sender's fault, before any model sees them: integer class indices below
    `classes` (or `ignore`, a language model's -100), `dims` dimensions per sample (0: an index per
    sample; 1: one per token); with `probabilities`, also a float distribution over the classes
    per sample (cross entropy's soft labels); with `samples` (a language model), an evaluation
    micro-batch's sample request (swarm.models.sampling)."""

    classes: int
    dims: int = 0
    ignore: int | None = None
    probabilities: bool = False
    samples: bool = False

    def problem(self, targets: torch.Tensor, evaluating: bool = False) -> str | None:
        """What is wrong with `targets` for this loss (`evaluating`: of an evaluation micro-batch), in
        a few words (None: nothing)."""
        shape, dtype = tuple(targets.shape), str(targets.dtype).removeprefix("torch.")
        if self.samples and is_sample_request(targets):
            return request_problem(targets) if evaluating else f"a sample request {shape} in a training micro-batch"
        if targets.is_floating_point() and self.probabilities and shape[1:] == (self.classes,):
            return None
        wanted = "class indices (int64)" + (
            f" or probabilities of shape (N, {self.classes})" if self.probabilities else ""
        )
        if targets.dtype not in INDEX_DTYPES:
            return f"{dtype} values of shape {shape}: the loss takes {wanted}"
        if targets.dim() != 1 + self.dims:
            per = "one per sample" if self.dims == 0 else f"{1 + self.dims}-D, one per token of each sample"
            return f"shape {shape}: the loss takes class indices, {per}"
        indices = targets if self.ignore is None else targets[targets != self.ignore]
        if indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= self.classes:
                return f"class index {low if low < 0 else high} outside 0..{self.classes - 1}"
        return None


@dataclass
class StagedModel:
    """A model cut into pipeline stages.

    Stage i takes stage i-1's output (stage 0 the batch input); the last returns logits.
    `metrics` returns sums and counts (e.g. correct, count, loss_sum) so micro-batches add up.
    `targets`: what its loss takes (None: not known, a user's loss; only finite values are checked).
    `whole`: the unsplit model whose modules the stages share, where the builder has one (a
    transformers causal LM): what an export saves (swarm.export).
    """

    stages: list[nn.Module]
    loss: LossFn
    metrics: MetricsFn
    tied: list[TiedPair] = field(default_factory=list)
    targets: Targets | None = None
    whole: nn.Module | None = None

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """All stages in order, in this process: the unsplit model's output, without a pipeline."""
        x = inputs
        for stage in self.stages:
            x = stage(x)
        return x

    def train(self, mode: bool = True) -> StagedModel:
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> StagedModel:
        return self.train(False)


def classifier(stages: list[nn.Module], num_classes: int) -> StagedModel:
    """Stages whose last gives `num_classes` logits per sample, with a classification loss."""
    return StagedModel(
        stages, classification_loss, classification_metrics, [], Targets(num_classes, probabilities=True)
    )


def language_model(
    stages: list[nn.Module], vocab: int, tied: list[TiedPair], whole: nn.Module | None = None
) -> StagedModel:
    """Stages of a causal language model of `vocab` tokens (cut from `whole`), with its loss
    (labels = inputs, shifted)."""
    targets = Targets(vocab, dims=1, ignore=-100, samples=True)
    return StagedModel(stages, causal_lm_loss, causal_lm_metrics, tied, targets, whole)


# ---- losses and metrics --------------------------------------------------------------------------


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums, not means: correct predictions, sample count and summed cross entropy."""
    logits = logits.detach().float()
    return {
        "correct": float((logits.argmax(dim=-1) == targets).sum()),
        "count": float(targets.numel()),
        "loss_sum": float(F.cross_entropy(logits, targets, reduction="sum")),
    }


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """As Hugging Face: logits[:, :-1] predict labels[:, 1:]; mean over tokens, -100 ignored."""
    vocab = logits.shape[-1]
    shifted = logits[:, :-1].float().reshape(-1, vocab)
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)


def causal_lm_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Token accuracy and summed token loss (perplexity = exp(loss_sum / count)); for a sample
    request in place of labels, the next token of each row instead (swarm.models.sampling)."""
    if is_sample_request(labels):
        return picked_tokens(logits, labels)
    vocab = logits.shape[-1]
    shifted = logits.detach()[:, :-1].float().reshape(-1, vocab)
    target = labels[:, 1:].reshape(-1).to(logits.device)
    keep = target != -100
    return {
        "correct": float(((shifted.argmax(dim=-1) == target) & keep).sum()),
        "count": float(keep.sum()),
        "loss_sum": float(F.cross_entropy(shifted, target, ignore_index=-100, reduction="sum")),
    }


def loss_metrics(loss: LossFn) -> MetricsFn:
    """Default metrics for a custom model: its loss as a sum, plus accuracy for class logits."""

    def metrics(output: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        count = output.shape[0] if output.dim() else 1
        out = {"count": float(count), "loss_sum": float(loss(output.detach(), targets)) * count}
        if output.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point() and len(targets) == count:
            out["correct"] = float((output.detach().argmax(dim=-1) == targets).sum())
        return out

    return metrics


def summarize(totals: dict[str, float], perplexity: bool = True) -> dict[str, float]:
    """Summed metrics -> means: loss, accuracy, and perplexity (language models) where present."""
    out: dict[str, float] = {}
    count = totals.get("count", 0.0)
    if count:
        if "loss_sum" in totals:
            out["loss"] = totals["loss_sum"] / count
            if perplexity:
                out["perplexity"] = math.exp(min(out["loss"], 700.0))
        if "correct" in totals:
            out["accuracy"] = totals["correct"] / count
    return out


# ---- where to cut ------------------------------------------------------------------------------


class StageCountError(ValueError):
    """More stages than a model can be split into (`registry.stage_count_problem` tells it apart)."""


def plan_cuts(
    name: str,
    num_blocks: int,
    num_stages: int,
    *,
    stem: bool = True,
    head: bool = True,
    split_after: Sequence[int] | None = None,
) -> list[int]:
    """Block indices after which the model is cut (len = num_stages - 1).

    The model is [stem?, block 0 .. block n-1, head?]; the stem always sits in stage 0 and the
    head in the last stage. A cut at -1 leaves the stem alone in stage 0, a cut at n-1 the head
    alone in the last stage. By default blocks are shared out evenly (extra stages isolate the
    head, then the stem); `split_after` picks the cuts explicitly.
    """
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"{name}: num_stages must be a positive integer, got {num_stages!r}")
    low = -1 if stem else 0
    high = num_blocks - 1 if head else num_blocks - 2
    most = high - low + 2
    if split_after is not None:
        cuts = [int(c) for c in split_after]
        if len(cuts) != num_stages - 1:
            raise ValueError(
                f"{name}: split_after needs {num_stages - 1} cut(s) for {num_stages} stages, got {len(cuts)}"
            )
        if any(c < low or c > high for c in cuts) or any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
            raise ValueError(f"{name}: split_after must be increasing block indices in {low}..{high}, got {cuts}")
        return cuts
    if num_stages > most:
        parts = " + stem" * stem + " + head" * head
        raise StageCountError(
            f"{name}: {num_blocks} blocks{parts} can be split into 1..{most} stages, not {num_stages}"
        )
    if num_stages <= num_blocks:
        return [(i * num_blocks) // num_stages - 1 for i in range(1, num_stages)]
    # more stages than blocks: one block per stage, then the head alone, then the stem alone
    cuts = list(range(num_blocks - 1))
    extra = num_stages - num_blocks
    if head and extra > 0:
        cuts.append(num_blocks - 1)
        extra -= 1
    if stem and extra > 0:
        cuts.insert(0, -1)
    return cuts


def stage_block_ranges(num_blocks: int, cuts: Sequence[int]) -> list[range]:
    """The blocks of each stage, from the cuts of `plan_cuts`."""
    bounds = [-1, *cuts, num_blocks - 1]
    return [range(bounds[i] + 1, bounds[i + 1] + 1) for i in range(len(bounds) - 1)]


# ---- a transformers config's errors -------------------------------------------------------------


def config_errors() -> tuple[type[Exception], ...]:
    """What a bad transformers config raises: ValueError, TypeError, and huggingface_hub's
    validation errors (transformers 5's configs are its strict dataclasses: no ValueErrors)."""
    from huggingface_hub.errors import StrictDataclassError  # only models built with transformers need it

    return (ValueError, TypeError, StrictDataclassError)
