"""CIFAR-10: torchvision's download, or an ImageFolder copy (`data_dir/train/<class>/*`, `data_dir/test/<class>/*`).

Train items get the paper's augmentation (reproducible: see `swarm.data.augment`), test items
ToTensor + Normalize. Sample ids are indices into the full train split, and for the test split
len(full train) + index, whatever subset is taken. An ImageFolder's classes are its sorted folder
names (the standard CIFAR-10 label order for the usual class names).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from swarm.config.messages import library_message
from swarm.data.augment import cifar_test_transform, cifar_train_transform
from swarm.data.base import SampleDataset, balanced_subset, require_dir


class CifarDataset(SampleDataset):
    """Images held as a uint8 array [N, H, W, 3] or read lazily from files."""

    def __init__(
        self, ids, images, labels, classes: list[str], augment: bool, seed: int = 0, crop_size: int = 32
    ) -> None:
        super().__init__(ids, seed)
        self.images = images  # np.ndarray [N, H, W, 3] uint8, or a list of image paths
        self.labels = [int(label) for label in labels]
        self.classes = list(classes)
        self.num_classes = len(self.classes)
        self.augment = augment
        self.crop_size = crop_size

    def image(self, index: int) -> np.ndarray:
        item = self.images[index]
        if isinstance(item, (str, Path)):
            with Image.open(item) as im:
                return np.asarray(im.convert("RGB"))
        return item

    def load(self, index: int, sample_id: int):
        image = self.image(index)
        if self.augment:
            x = cifar_train_transform(image, self.generator(sample_id), size=self.crop_size)
        else:
            x = cifar_test_transform(image)
        return x, self.labels[index]


def image_folder(root: Path) -> tuple[list[str], list[int], list[str]]:
    # torchvision is imported when CIFAR-10 is built: swarm.data's registry imports every dataset
    # module, and runs on the other datasets need not load it.
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(str(root))
    except (FileNotFoundError, RuntimeError) as e:
        raise ValueError(f"cifar10: {root} is not an ImageFolder ({library_message(e)})") from None
    paths = [path for path, _ in folder.samples]
    return paths, [label for _, label in folder.samples], list(folder.classes)


def _torchvision(root: str, train: bool) -> tuple[np.ndarray, list[int], list[str]]:
    from torchvision.datasets import CIFAR10  # as in image_folder: only CIFAR-10 runs load torchvision

    try:
        data = CIFAR10(root=str(Path(root).expanduser()), train=train, download=True)
    except Exception as e:  # offline, bad checksum, unwritable root: one line, not a deep traceback
        raise ValueError(
            f"cifar10: could not get CIFAR-10 into {root!r} ({type(e).__name__}: {library_message(e)});"
            " pass data_dir= an ImageFolder copy to read local files"
        ) from None
    return data.data, list(data.targets), list(data.classes)


@dataclass(frozen=True)
class CifarOptions:
    """CIFAR-10's options (a config's `data.options`)."""

    root: str = "./data"
    augment: bool = True
    subset: int | None = None
    test_subset: int | None = None
    subset_seed: int = 0
    preload: bool = False


def build_cifar10(
    data_dir: str | None = None,
    seed: int = 0,
    options: CifarOptions = CifarOptions(),
) -> tuple[CifarDataset, CifarDataset]:
    """(train, test). `subset`/`test_subset`: seeded class-balanced parts; `preload`: decode files once into memory.

    Without `data_dir`, torchvision downloads the official set into `root`.
    """
    if data_dir is not None:
        base = require_dir("cifar10", data_dir)
        train_dir, test_dir = base / "train", base / "test"
        for part in (train_dir, test_dir):
            require_dir("cifar10", part, "folder")
        train_images, train_labels, classes = image_folder(train_dir)
        test_images, test_labels, test_classes = image_folder(test_dir)
        if test_classes != classes:
            raise ValueError(f"cifar10: train classes {classes} differ from test classes {test_classes}")
    else:
        train_images, train_labels, classes = _torchvision(options.root, True)
        test_images, test_labels, _ = _torchvision(options.root, False)

    def make(images, labels, offset: int, size: int | None, train: bool) -> CifarDataset:
        keep = np.arange(len(labels)) if size is None else balanced_subset(labels, size, options.subset_seed, "cifar10")
        picked = [images[i] for i in keep] if isinstance(images, list) else images[keep]
        dataset = CifarDataset(
            keep + offset, picked, [labels[i] for i in keep], classes, options.augment and train, seed
        )
        if options.preload and isinstance(picked, list):
            dataset.images = (
                np.stack([dataset.image(i) for i in range(len(dataset))])
                if len(dataset)
                else np.zeros((0, 32, 32, 3), np.uint8)
            )
        return dataset

    train = make(train_images, train_labels, 0, options.subset, True)
    test = make(test_images, test_labels, len(train_labels), options.test_subset, False)
    return train, test
