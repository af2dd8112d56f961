"""The synchronous step, written once for both transports.

After the last micro-batch of a step went backward, every stage's gradients are made what the
unsplit model's would be, then every stage's optimizer steps:
1. gather: each stage sums the gradients of its micro-batches (a replicated stage: over its
   replicas too) and hands over those the step must combine: tied parameters' (shared between the
   first and the last stage, e.g. GPT-2's embedding and LM head) and all of a replicated stage's;
2. tie: both copies of a tied parameter get the sum of the two gradients (Megatron's way);
3. set gradients: the combined gradients go back where they belong, and each stage reports its
   squared gradient norm when gradients are clipped;
4. apply: gradients are scaled to the global norm limit (a tied parameter counted once, as in the
   unsplit model), and every stage steps its optimizer and schedule.

The transport provides the rounds (`StepRounds`): the in-process one calls its stage runtimes,
the hivemind one sends each round to every stage peer. Sums are taken in stage order, so both
give the same floats.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import torch

from swarm.models import TiedPair

Grads = dict[int, dict[str, torch.Tensor]]  # stage -> parameter name -> gradient


class StepRounds(Protocol):
    def gather(self, wanted: dict[int, list[str]]) -> Grads:
        """Round 1: every stage's gradients of the parameters `wanted[stage]`, and of every parameter
        of a replicated stage, summed over the stage's replicas."""

    def replicated(self, stage: int) -> bool:
        """Whether `stage` runs on several replicas (their summed gradients must be set back)."""

    def set_gradients(self, grads: Grads, norm: bool) -> float:
        """Round 2: replaces these gradients; with `norm`, the sum over stages of their squared norms."""

    def apply(self, scale: float) -> float:
        """Round 3: gradients times `scale` (0: left as they are), then the optimizer step; the learning rate."""


def tied_names(tied: Sequence[TiedPair]) -> dict[int, list[str]]:
    """Per stage, the parameters whose gradients tying needs."""
    wanted: dict[int, list[str]] = defaultdict(list)
    for pair in tied:
        for stage, name in (pair.first, pair.second):
            wanted[stage].append(name)
    return dict(wanted)


def tie(gathered: Grads, tied: Sequence[TiedPair], grads: Grads) -> list[float]:
    """Adds to `grads` both copies of every tied parameter, set to the sum of their gradients;
    returns each sum's squared norm (what clipping counts twice and takes back once)."""
    squares = []
    for pair in tied:
        if pair.first == pair.second:
            continue
        first, second = (gathered.get(stage, {}).get(name) for stage, name in (pair.first, pair.second))
        if first is None and second is None:
            continue
        if first is None:
            first = torch.zeros_like(second)
        if second is None:
            second = torch.zeros_like(first)
        total = first + second.to(first.device)
        for stage, name in (pair.first, pair.second):
            grads.setdefault(stage, {})[name] = total
        squares.append(float(total.detach().float().pow(2).sum()))
    return squares


def clip_scale(squares: float, tied_squares: Sequence[float], grad_clip: float | None) -> float:
    """The factor that brings the global gradient norm down to `grad_clip` (0: no scaling needed)."""
    if grad_clip is None:
        return 0.0
    for square in tied_squares:  # a tied parameter counts once, as in the unsplit model
        squares -= square
    norm = math.sqrt(max(squares, 0.0))
    return grad_clip / (norm + 1e-6) if norm > grad_clip else 0.0


def synchronous_step(rounds: StepRounds, tied: Sequence[TiedPair], grad_clip: float | None) -> float:
    """Gather, tie, set, clip and apply; returns the learning rate the step used."""
    gathered = rounds.gather(tied_names(tied))
    grads: Grads = {stage: dict(named) for stage, named in gathered.items() if rounds.replicated(stage)}
    tied_squares = tie(gathered, tied, grads)
    squares = 0.0
    if grads or grad_clip is not None:
        squares = rounds.set_gradients(grads, norm=grad_clip is not None)
    return rounds.apply(clip_scale(squares, tied_squares, grad_clip))
