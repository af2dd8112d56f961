"""Small models for scikit-learn's 8x8 digits (the offline default data): fast on a CPU.

`digits_cnn`: conv(1->w) | conv(w->2w) + max-pool | linear(32w->hidden) | linear(hidden->classes);
each piece is a block, so it splits into 1..4 stages with boundaries [B,w,8,8], [B,2w,4,4], [B,hidden].
`digits_mlp`: `depth` linear layers, splittable into 1..depth stages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from swarm.models.base import StagedModel, classifier, plan_cuts, stage_block_ranges


def _check_positive(name: str, **values) -> None:
    for option, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {option} must be a positive integer, got {value!r}")


def _staged(
    name: str, blocks: list[nn.Module], num_stages: int, split_after: Sequence[int] | None, num_classes: int
) -> StagedModel:
    cuts = plan_cuts(name, len(blocks), num_stages, stem=False, head=False, split_after=split_after)
    stages = [
        nn.Sequential(OrderedDict((f"block{i}", blocks[i]) for i in blocks_of_stage))
        for blocks_of_stage in stage_block_ranges(len(blocks), cuts)
    ]
    return classifier(stages, num_classes)


def cnn_blocks(
    num_classes: int = 10, width: int = 32, hidden: int = 128, in_channels: int = 1, image_size: int = 8
) -> list[nn.Module]:
    side = image_size // 2
    return [
        nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(2 * width * side * side, hidden), nn.ReLU()),
        nn.Linear(hidden, num_classes),
    ]


def build_digits_cnn(
    num_stages: int,
    num_classes: int = 10,
    width: int = 32,
    hidden: int = 128,
    in_channels: int = 1,
    image_size: int = 8,
    split_after: Sequence[int] | None = None,
) -> StagedModel:
    _check_positive("digits_cnn", num_classes=num_classes, width=width, hidden=hidden, in_channels=in_channels)
    if not isinstance(image_size, int) or image_size < 2 or image_size % 2:
        raise ValueError(f"digits_cnn: image_size must be an even integer >= 2, got {image_size!r}")
    plan_cuts("digits_cnn", 4, num_stages, stem=False, head=False, split_after=split_after)
    return _staged(
        "digits_cnn",
        cnn_blocks(num_classes, width, hidden, in_channels, image_size),
        num_stages,
        split_after,
        num_classes,
    )


def build_digits_mlp(
    num_stages: int,
    num_classes: int = 10,
    hidden: int = 128,
    depth: int = 3,
    in_features: int = 64,
    split_after: Sequence[int] | None = None,
) -> StagedModel:
    _check_positive("digits_mlp", num_classes=num_classes, hidden=hidden, depth=depth, in_features=in_features)
    plan_cuts("digits_mlp", depth, num_stages, stem=False, head=False, split_after=split_after)
    blocks: list[nn.Module] = []
    for i in range(depth):
        fan_in = in_features if i == 0 else hidden
        if i == depth - 1:
            layer: nn.Module = nn.Linear(fan_in, num_classes)
        else:
            layer = nn.Sequential(nn.Linear(fan_in, hidden), nn.ReLU())
        blocks.append(nn.Sequential(nn.Flatten(), layer) if i == 0 else layer)
    return _staged("digits_mlp", blocks, num_stages, split_after, num_classes)
