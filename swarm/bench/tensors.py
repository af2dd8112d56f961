"""Realistic boundary tensors for codec benchmarks, made from a seed (no download needed).

- post-ReLU ResNet-18 (CIFAR) boundaries: per-channel scale and bias before the ReLU, so
  channels differ in magnitude and sparsity as real feature maps do (~50% zeros);
- a GPT-2-like residual-stream activation: per-channel scales with a few outlier channels;
- an activation gradient of the same shape: heavy-tailed (Student-t) and small;
- an anisotropic residual stream of the same shape: tokens drawn with a covariance whose
  spectrum falls as 1/i (singular value i of the [tokens, hidden] matrix ~ 1/i) in random
  directions, the low-rank structure real hidden states have and the two above lack (an
  assumption for the low-rank codecs' rows, not a measurement of a trained model).

`benchmark_tensors(..., next_batch=True)` gives another micro-batch of the same boundaries: the
same channel scales and directions, other tokens (what a subspace codec's held basis meets).
"""

from __future__ import annotations

import torch


def post_relu(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    channels = shape[1]
    scale = torch.exp(0.5 * torch.randn(channels, generator=gen)).view(1, -1, 1, 1)
    bias = (0.5 * torch.randn(channels, generator=gen) - 0.3).view(1, -1, 1, 1)
    return torch.relu(torch.randn(shape, generator=gen) * scale + bias)


def _tokens(shape: tuple[int, ...], gen: torch.Generator, other: torch.Generator | None) -> torch.Tensor:
    """Standard normal tokens from `gen`, or from `other` (gen still draws them: what follows
    from gen stays the same, so the other micro-batch's structure is this one's)."""
    values = torch.randn(shape, generator=gen)
    return values if other is None else torch.randn(shape, generator=other)


def transformer_activation(
    shape: tuple[int, ...], gen: torch.Generator, other: torch.Generator | None = None
) -> torch.Tensor:
    width = shape[-1]
    scale = torch.exp(0.4 * torch.randn(width, generator=gen))
    outliers = torch.randperm(width, generator=gen)[: max(1, width // 128)]
    scale[outliers] *= 20.0
    return _tokens(shape, gen, other) * scale


def activation_gradient(
    shape: tuple[int, ...], gen: torch.Generator, other: torch.Generator | None = None
) -> torch.Tensor:
    normal = _tokens(shape, gen, other)
    chi = _tokens((3, *shape), gen, other).pow_(2).sum(0).div_(3).sqrt_()
    return normal.div_(chi).mul_(1e-4)  # Student-t with 3 degrees of freedom, scaled


def anisotropic_activation(
    shape: tuple[int, ...], gen: torch.Generator, other: torch.Generator | None = None
) -> torch.Tensor:
    width = shape[-1]
    directions = torch.linalg.qr(torch.randn((width, width), generator=gen)).Q
    spectrum = 1.0 / torch.arange(1, width + 1, dtype=torch.float32)
    tokens = _tokens((*shape[:-1], width), gen, other)
    return (tokens * spectrum) @ directions.T


def benchmark_tensors(scale: float = 1.0, seed: int = 0, next_batch: bool = False) -> dict[str, torch.Tensor]:
    """name -> tensor; `scale` < 1 shrinks the batch dimension for quick runs; `next_batch`: the
    [tokens x hidden] tensors of another micro-batch (other tokens, the same structure)."""
    gen = torch.Generator().manual_seed(seed)
    other = torch.Generator().manual_seed(seed + 1) if next_batch else None

    def batch(n: int) -> int:
        return max(1, round(n * scale))

    return {
        "resnet18.layer1 [100,64,32,32]": post_relu((batch(100), 64, 32, 32), gen),
        "resnet18.layer2 [100,128,16,16]": post_relu((batch(100), 128, 16, 16), gen),
        "gpt2.activation [8,1024,768]": transformer_activation((batch(8), 1024, 768), gen, other),
        "gpt2.gradient [8,1024,768]": activation_gradient((batch(8), 1024, 768), gen, other),
        "gpt2.anisotropic [8,1024,768]": anisotropic_activation((batch(8), 1024, 768), gen, other),
    }
