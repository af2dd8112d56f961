"""Your own image folder for classification, read as the cifar10 ImageFolder copy is.

Layouts of `dir`:
- `dir/train/<class>/*` and `dir/test/<class>/*` (the same class folders in both);
- `dir/<class>/*`, split per class: the last `test_fraction` (default 0.1; 0 gives an empty test
  set) of each class's files, in name order, are the test split. A fixed rule rather than a
  seeded draw, so the split and the ids depend only on the files and the options.

Classes are the sorted folder names (label i = classes[i]). Hidden files and folders (names
starting with a dot) are left out, and every other file is opened (its header) when the dataset is
built: one that is not an image fails the build, not the run. Every image is converted to RGB and
resized to `image_size` x `image_size` (bilinear; the aspect ratio is not kept) when it has
another size. Train items get cifar10's crop-and-flip augmentation (random crop with 4 pixels of
padding, horizontal flip) drawn per (seed, epoch, sample id); every item is normalized with
`mean`/`std` (default: CIFAR-10's). Ids: 0..n_train-1 for train, n_train.. for test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from swarm.config.messages import library_message
from swarm.data.augment import CIFAR10_MEAN, CIFAR10_STD, normalize, random_crop, random_hflip, to_tensor
from swarm.data.base import require_dir
from swarm.data.cifar import CifarDataset, image_folder

NAME = "images"
PADDING = 4  # cifar10's crop padding (swarm.data.augment.cifar_train_transform's default)


@dataclass(frozen=True)
class ImageForm:
    """What every image of a folder becomes: `size` x `size` pixels, normalized with `mean`/`std`."""

    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


class ImageFolderDataset(CifarDataset):
    """CifarDataset over image files resized to one size, normalized with the given statistics."""

    def __init__(self, ids, paths, labels, classes, augment: bool, seed: int, form: ImageForm) -> None:
        super().__init__(ids, paths, labels, classes, augment, seed, crop_size=form.size)
        self.mean, self.std = form.mean, form.std

    def image(self, index: int) -> np.ndarray:
        try:
            image = super().image(index)  # RGB uint8 [H, W, 3]
        except Exception as e:  # a body the build's header check could not see (truncated)
            raise _unreadable(self.images[index], e) from None
        size = self.crop_size
        if image.shape[:2] != (size, size):
            image = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))
        return image

    def load(self, index: int, sample_id: int):
        # cifar_train_transform's steps, with this folder's mean/std in place of CIFAR-10's fixed ones
        x = to_tensor(self.image(index))
        if self.augment:
            generator = self.generator(sample_id)
            x = random_hflip(random_crop(x, self.crop_size, PADDING, generator), generator)
        return normalize(x, self.mean, self.std), self.labels[index]


def _hidden(path: Path, root: Path) -> bool:
    """A file in or under a folder whose name starts with a dot (.DS_Store, ._photo.png, .thumbnails/)."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _check_classes(root: Path) -> None:
    """One-line errors for what torchvision's ImageFolder would refuse with a long message."""
    from torchvision.datasets.folder import IMG_EXTENSIONS  # as cifar10: only image runs load torchvision

    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{NAME}: {str(root)!r} has no class folders (expected {root}/<class>/<image files>)")
    for folder in classes:
        files = (f for f in folder.rglob("*") if f.is_file() and not _hidden(f, root))
        if not any(f.name.lower().endswith(IMG_EXTENSIONS) for f in files):
            raise ValueError(
                f"{NAME}: class {folder.name!r} ({str(folder)!r}) has no images ({', '.join(IMG_EXTENSIONS)})"
            )


def _unreadable(path: str, error: Exception) -> ValueError:
    """One line naming the file (PIL's errors say little, some not which file)."""
    return ValueError(f"{NAME}: {path} is not a readable image ({library_message(error)})")


def _folder(root: Path) -> tuple[list[str], list[int], list[str]]:
    """Paths, labels and classes of an ImageFolder, hidden files left out and every other file
    opened (its header: about a tenth of a millisecond), so that one that is not an image stops the
    build in one line rather than the run at the first step or evaluation that reaches it."""
    _check_classes(root)
    paths, labels, classes = image_folder(root)
    kept = [(p, label) for p, label in zip(paths, labels, strict=True) if not _hidden(Path(p), root)]
    for path, _ in kept:
        try:
            Image.open(path).close()
        except Exception as e:  # not an image, a decompression bomb: the file's fault, not the run's
            raise _unreadable(path, e) from None
    return [p for p, _ in kept], [label for _, label in kept], classes


def _stats(what: str, value) -> tuple[float, ...]:
    if (
        not isinstance(value, Sequence)
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{NAME}: {what} must be 3 numbers (red, green, blue), got {value!r}")
    if what == "std" and min(value) <= 0:
        raise ValueError(f"{NAME}: std must be positive, got {value!r}")
    return tuple(float(v) for v in value)


def _split_per_class(labels: list[int], fraction: float) -> tuple[list[int], list[int]]:
    """Indices of train and test: each class's last `fraction` of files (ImageFolder lists them sorted)."""
    train, test = [], []
    for label in sorted(set(labels)):
        members = [i for i, y in enumerate(labels) if y == label]
        cut = len(members) - int(len(members) * fraction)
        train.extend(members[:cut])
        test.extend(members[cut:])
    return train, test


@dataclass(frozen=True)
class ImagesOptions:
    """An image folder's options (a config's `data.options`)."""

    dir: str | None = None
    image_size: int = 32
    test_fraction: float | None = None
    augment: bool = True
    mean: Sequence[float] = CIFAR10_MEAN
    std: Sequence[float] = CIFAR10_STD


def build_images(
    data_dir: str | None = None,
    seed: int = 0,
    options: ImagesOptions = ImagesOptions(),
) -> tuple[ImageFolderDataset, ImageFolderDataset]:
    """(train, test) of an image folder; `dir` is relative to `data_dir` when that is set."""
    if not isinstance(options.image_size, int) or isinstance(options.image_size, bool) or options.image_size < 1:
        raise ValueError(f"{NAME}: image_size must be a positive integer, got {options.image_size!r}")
    if not isinstance(options.augment, bool):
        raise ValueError(f"{NAME}: augment must be true or false, got {options.augment!r}")
    form = ImageForm(options.image_size, _stats("mean", options.mean), _stats("std", options.std))
    if options.dir is None and data_dir is None:
        raise ValueError(f"{NAME}: dir is required (a folder of <class>/ or train/<class>/ and test/<class>/)")
    base = Path(data_dir).expanduser() if data_dir is not None else Path.cwd()
    root = require_dir(NAME, base / Path(options.dir).expanduser() if options.dir is not None else base, "dir")

    if (root / "train").is_dir():
        if options.test_fraction is not None:
            raise ValueError(
                f"{NAME}: {str(root)!r} has train/ and test/ folders; test_fraction is for <class>/ folders"
            )
        test_root = require_dir(NAME, root / "test", "test folder (next to train/)")
        paths, labels, classes = _folder(root / "train")
        test_paths, test_labels, test_classes = _folder(test_root)
        if test_classes != classes:
            raise ValueError(f"{NAME}: train classes {classes} differ from test classes {test_classes}")
    else:
        fraction = 0.1 if options.test_fraction is None else options.test_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise ValueError(f"{NAME}: test_fraction must be a number in [0, 1), got {options.test_fraction!r}")
        all_paths, all_labels, classes = _folder(root)
        keep, held = _split_per_class(all_labels, float(fraction))
        paths, labels = [all_paths[i] for i in keep], [all_labels[i] for i in keep]
        test_paths, test_labels = [all_paths[i] for i in held], [all_labels[i] for i in held]

    n = len(paths)
    train = ImageFolderDataset(np.arange(n), paths, labels, classes, options.augment, seed, form)
    test = ImageFolderDataset(np.arange(n, n + len(test_paths)), test_paths, test_labels, classes, False, seed, form)
    return train, test
