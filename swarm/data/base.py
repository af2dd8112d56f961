"""Datasets whose samples carry stable integer ids, and the collate that batches them.

Every item is `(sample_id, input, target)`. Ids are fixed by the data and the dataset options
(never by shuffling or subsetting) and are unique across a dataset's train and test splits, so
per-sample state (AQ-SGD buffers) can be keyed by them. Randomness inside an item (augmentation)
comes from a generator seeded by (seed, epoch, sample_id): the same config and seed give the
same inputs in any process, any worker and any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from a few integers (numpy SeedSequence)."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1
    )


class SampleDataset(Dataset):
    """Base class: subclasses implement `load(index, sample_id) -> (input, target)`."""

    num_classes: int | None = None

    def __init__(self, ids: Sequence[int] | torch.Tensor, seed: int = 0) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        self.seed = int(seed)
        self.epoch = 0

    def __len__(self) -> int:
        return int(self.ids.numel())

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation of this epoch (call before iterating; workers copy it)."""
        self.epoch = int(epoch)

    def generator(self, sample_id: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(mix_seed(self.seed, self.epoch, sample_id))
        return g

    def load(self, index: int, sample_id: int):
        raise NotImplementedError

    def __getitem__(self, index: int):
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        sample_id = int(self.ids[index])
        x, y = self.load(index, sample_id)
        return sample_id, x, y


def collate(items):
    """[(id, x, y), ...] -> (ids LongTensor[B], inputs [B, ...], targets [B, ...])."""
    ids = torch.tensor([int(item[0]) for item in items], dtype=torch.long)
    inputs = torch.stack([torch.as_tensor(item[1]) for item in items])
    targets = [item[2] for item in items]
    if isinstance(targets[0], torch.Tensor):
        return ids, inputs, torch.stack(targets)
    return ids, inputs, torch.tensor(targets, dtype=torch.long if isinstance(targets[0], int) else None)


def require_dir(name: str, path: str | Path, what: str = "data_dir") -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"{name}: {what} {str(path)!r} does not exist or is not a directory")
    return path


def balanced_subset(labels: Sequence[int] | np.ndarray, size: int, seed: int, name: str) -> np.ndarray:
    """Sorted indices of a seeded subset with (almost) equally many samples of each class."""
    labels = np.asarray(labels)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name}: subset must be a positive integer, got {size!r}")
    if size > len(labels):
        raise ValueError(f"{name}: subset={size} is larger than the {len(labels)} samples available")
    classes = np.unique(labels)
    rng = np.random.default_rng(seed)
    share, extra = divmod(size, len(classes))
    chosen = []
    for rank, c in enumerate(classes):
        members = np.flatnonzero(labels == c)
        want = share + (1 if rank < extra else 0)
        if want > len(members):
            raise ValueError(f"{name}: subset={size} needs {want} samples of class {c}, only {len(members)} exist")
        chosen.append(rng.permutation(members)[:want])
    return np.sort(np.concatenate(chosen))
