"""The paper's CIFAR-10 transforms, with randomness drawn from an explicit generator.

Train: RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor + Normalize; test: ToTensor +
Normalize. Torchvision's transforms draw from the global RNG (so results depend on worker and
order); these take a `torch.Generator`, which the dataset seeds per (seed, epoch, sample id).
Cropping zero-padded tensors equals cropping zero-padded PIL images, then ToTensor.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# kuangliu/pytorch-cifar's constants, which the paper's code used
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)


def to_tensor(image) -> torch.Tensor:
    """An HWC uint8 image (numpy array or PIL image) -> CHW float in [0, 1], as ToTensor."""
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div(255.0)


def normalize(x: torch.Tensor, mean=CIFAR10_MEAN, std=CIFAR10_STD) -> torch.Tensor:
    m = torch.tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x - m) / s


def random_crop(x: torch.Tensor, size: int, padding: int, generator: torch.Generator) -> torch.Tensor:
    padded = F.pad(x, (padding, padding, padding, padding)) if padding else x
    height, width = padded.shape[-2:]
    if height < size or width < size:
        raise ValueError(f"random crop of {size} from an image of {height}x{width} (padding included)")
    top = int(torch.randint(0, height - size + 1, (1,), generator=generator))
    left = int(torch.randint(0, width - size + 1, (1,), generator=generator))
    return padded[..., top : top + size, left : left + size]


def random_hflip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    if float(torch.rand((1,), generator=generator)) < p:
        return x.flip(-1)
    return x


def cifar_train_transform(image, generator: torch.Generator, size: int = 32, padding: int = 4) -> torch.Tensor:
    x = to_tensor(image)
    x = random_crop(x, size, padding, generator)
    x = random_hflip(x, generator)
    return normalize(x)


def cifar_test_transform(image) -> torch.Tensor:
    return normalize(to_tensor(image))
