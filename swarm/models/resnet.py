"""ResNet-18 for CIFAR (as kuangliu/pytorch-cifar), cut into pipeline stages.

3x3 stem (stride 1, no max-pool), four layers of two BasicBlocks, average pool, linear head.
Four stages cut after layer1, layer2 and layer3, the paper's split: at width 64 on 32x32 input
the boundaries carry [B,64,32,32], [B,128,16,16] and [B,256,8,8].
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.base import StagedModel, classifier, plan_cuts, stage_block_ranges


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """The unsplit model; `blocks[i]` is layer{i // 2 + 1}[i % 2]."""

    def __init__(self, num_classes: int = 10, width: int = 64, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        blocks = []
        in_planes = width
        for layer, stride in enumerate((1, 2, 2, 2)):
            planes = width * 2**layer
            for first in (True, False):
                blocks.append(BasicBlock(in_planes, planes, stride if first else 1))
                in_planes = planes
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_planes, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_name(index: int) -> str:
    return f"layer{index // 2 + 1}_{index % 2}"


def cut(model: ResNet18, num_stages: int, split_after: Sequence[int] | None = None) -> list[nn.Module]:
    """Stages sharing the modules (and so the weights) of `model`."""
    n = len(model.blocks)
    cuts = plan_cuts("resnet18", n, num_stages, split_after=split_after)
    stages = []
    for index, blocks in enumerate(stage_block_ranges(n, cuts)):
        parts: OrderedDict[str, nn.Module] = OrderedDict()
        if index == 0:
            parts["stem"] = model.stem
        for i in blocks:
            parts[block_name(i)] = model.blocks[i]
        if index == num_stages - 1:
            parts["head"] = model.head
        stages.append(nn.Sequential(parts))
    return stages


def build_resnet18(
    num_stages: int,
    num_classes: int = 10,
    width: int = 64,
    in_channels: int = 3,
    split_after: Sequence[int] | None = None,
) -> StagedModel:
    """ResNet-18 (CIFAR variant). Default cuts: blocks shared out evenly, i.e. after layer1..3 for 4 stages."""
    for option, value in (("num_classes", num_classes), ("width", width), ("in_channels", in_channels)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"resnet18: {option} must be a positive integer, got {value!r}")
    plan_cuts("resnet18", 8, num_stages, split_after=split_after)  # fail before building anything
    model = ResNet18(num_classes=num_classes, width=width, in_channels=in_channels)
    return classifier(cut(model, num_stages, split_after), num_classes)
