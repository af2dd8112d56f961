"""scikit-learn's bundled 8x8 digits: real data that needs no download (the offline default).

1,797 images, 10 classes; a fixed seeded split (default 1,500 train / 297 test). Inputs are
[1, 8, 8] floats standardised with the train split's pixel mean and std; `upscale=True` makes
them [3, 32, 32] (bilinear) so CIFAR models such as resnet18 run on them. `subset` and `test_subset`
keep seeded class-balanced parts of either split (as cifar10's). Sample ids are the indices into
load_digits(), unique across both splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.data.base import SampleDataset, balanced_subset


class DigitsDataset(SampleDataset):
    num_classes = 10

    def __init__(self, ids: torch.Tensor, images: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> None:
        super().__init__(ids, seed)
        self.images = images
        self.labels = labels

    def load(self, index: int, sample_id: int):
        return self.images[index], int(self.labels[index])


@dataclass(frozen=True)
class DigitsOptions:
    """The digits' options (a config's `data.options`)."""

    split_seed: int = 0
    train_size: int = 1500
    upscale: bool = False
    subset: int | None = None
    test_subset: int | None = None


def build_digits(
    data_dir: str | None = None,
    seed: int = 0,
    options: DigitsOptions = DigitsOptions(),
) -> tuple[DigitsDataset, DigitsDataset]:
    """(train, test); `subset` and `test_subset` keep seeded class-balanced parts of the splits."""
    # scikit-learn is a large import that only this dataset needs: loaded when the digits are built.
    from sklearn.datasets import load_digits

    if data_dir is not None:
        raise ValueError("digits: data_dir is not used (the data ships with scikit-learn); leave it unset")
    bunch = load_digits()
    total = len(bunch.target)
    if not isinstance(options.train_size, int) or not 0 < options.train_size < total:
        raise ValueError(f"digits: train_size must be an integer in 1..{total - 1}, got {options.train_size!r}")
    order = torch.randperm(total, generator=torch.Generator().manual_seed(int(options.split_seed)))
    train_ids, test_ids = order[: options.train_size].sort().values, order[options.train_size :].sort().values

    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    mean, std = images[train_ids].mean(), images[train_ids].std()
    images = (images - mean) / std
    if options.upscale:
        images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    labels = torch.tensor(bunch.target, dtype=torch.long)

    def part(ids: torch.Tensor, size: int | None, name: str) -> torch.Tensor:
        if size is None:
            return ids
        return ids[torch.from_numpy(balanced_subset(labels[ids].numpy(), size, options.split_seed, name))]

    train_ids, test_ids = part(train_ids, options.subset, "digits"), part(test_ids, options.test_subset, "digits test")

    def make(ids: torch.Tensor) -> DigitsDataset:
        return DigitsDataset(ids, images[ids].contiguous(), labels[ids], seed)

    return make(train_ids), make(test_ids)
