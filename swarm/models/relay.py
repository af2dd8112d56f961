"""`relay`: a model for link benchmarks, with real boundary sizes and almost no compute.

Every boundary carries a tensor of a real model's boundary size (by default ResNet-18's layer1
output, [B, 64, 32, 32], post-ReLU like the real one; `tokens` gives GPT-2's [B, 1024, 768]
hidden states), while each stage does one cheap layer, so a 2-core machine can push enough
samples per second to make the network, not the compute, the bottleneck. Inputs are [3, 32, 32]
images (digits with `upscale: true`, or CIFAR-10).
"""

from __future__ import annotations

import torch
from torch import nn

from swarm.models.base import StageCountError, StagedModel, classifier


class _ToMaps(nn.Module):
    """Image -> [B, C, H, W] post-ReLU maps (a 1x1 convolution after resizing)."""

    def __init__(self, channels: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.conv = nn.Conv2d(3, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            x = nn.functional.interpolate(x, size=(self.size, self.size), mode="nearest")
        return torch.relu(self.conv(x))


class _MapsRelay(nn.Module):
    """A depthwise 3x3 convolution and ReLU: same shape, little compute."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class _ToTokens(nn.Module):
    """Image -> [B, T, D] hidden states: a projection of the image plus a position embedding."""

    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.project = nn.Linear(3 * 32 * 32, width)
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.project(x.flatten(1))[:, None, :] + self.position)


class _TokensRelay(nn.Module):
    """A per-channel scale and shift and GELU (a stand-in for a transformer block's cost-free part)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x * self.scale + self.shift)


class _Head(nn.Module):
    def __init__(self, features: int, num_classes: int, tokens: bool) -> None:
        super().__init__()
        self.tokens = tokens
        self.linear = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.mean(dim=1) if self.tokens else x.mean(dim=(2, 3))
        return self.linear(pooled)


def build_relay(num_stages: int, boundary: str = "resnet18.layer1", num_classes: int = 10) -> StagedModel:
    """`boundary`: resnet18.layer1 [64,32,32], resnet18.layer2 [128,16,16] or gpt2 [1024,768]."""
    shapes = {"resnet18.layer1": (64, 32), "resnet18.layer2": (128, 16), "gpt2": (1024, 768)}
    if boundary not in shapes:
        raise ValueError(f"relay: boundary must be one of {', '.join(shapes)}, got {boundary!r}")
    if not isinstance(num_stages, int) or num_stages < 2:
        raise StageCountError(
            f"relay: needs at least 2 stages (it exists to load the links between them), got {num_stages!r}"
        )
    tokens = boundary == "gpt2"
    first, width = shapes[boundary]
    if tokens:
        stem, relay, features = _ToTokens(first, width), lambda: _TokensRelay(width), width
    else:
        stem, relay, features = _ToMaps(first, width), lambda: _MapsRelay(first), first
    stages = (
        [stem]
        + [relay() for _ in range(num_stages - 2)]
        + [nn.Sequential(relay(), _Head(features, num_classes, tokens))]
    )
    return classifier(stages, num_classes)
