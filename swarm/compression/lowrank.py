"""`lowrank:R`: a tensor sent as two rank-R factors, for [tokens x hidden] boundaries.

The tensor is viewed as a matrix M, rows x cols, with cols its last dimension (for [batch,
tokens, hidden] activations or gradients: batch*tokens x hidden, one right factor shared by the
micro-batch), so a message costs about 16 R (rows + cols) / (rows cols) bits per element with fp16
factors. The factors come from a randomized range finder (Halko, Martinsson and Tropp) with a few
power iterations, as in PowerSGD: a sketch Y = M S of R + OVERSAMPLE columns, its orthonormal
basis refined by ITERATIONS rounds of B <- orth(M orth(M^T B)), then the SVD of the small matrix
B^T M gives the best rank-R factors within that basis. Each factor gets the square root of the
singular values, so both have entries of the same scale (fp16 factors neither overflow on large
activations nor underflow on small gradients as readily as an orthonormal one and a scaled one).

Plain `lowrank:R` is stateless and deterministic: the sketch S is drawn from a generator seeded with a
constant, per (cols, width), so the same tensor gives the same bytes every time (with the same
torch thread count, as the model's own compute; decoding, one product over the rank, gives the
same floats at any thread count, which the two ends of an EF21 link rely on).
`lowrank:R/warm` adds PowerSGD's warm start (`swarm.compression.warm`): a link's sender starts
from the directions of its last delivered message's right factor in place of S's first R columns
(S's other columns still oversample) and runs WARM_ITERATIONS (1) power iterations instead of
ITERATIONS (2). That is state per link, on the sender only, changed on delivery only, like error
feedback's: the message is a plain low-rank payload, and micro-batches cross a link in the
trainer's order, so a swarm sends the bytes one process does.

Factors travel in fp16 (default), bf16 or fp32, or k-bit quantized with one range per rank
component (`/q8`). Decoding computes left^T @ right in float32 and saturates what the tensor's own
dtype cannot hold. Non-finite input is refused, as the quantizer refuses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from protocols.message import Encoded, LowRankPart
from protocols.wire import matrix_of
from swarm.compression.codecs import Cast, Codec, Quantize, ValueCodec, inner_spec

OVERSAMPLE = 4  # extra sketch columns: the top R directions are found far better than with R alone
ITERATIONS = 2  # power iterations: enough for activations whose spectrum decays slowly
# power iterations from the previous delivered message's directions (`/warm`): a start already near
# the top subspace needs one round where a random sketch needs two (PowerSGD runs one)
WARM_ITERATIONS = 1
_SEED = 0x10A2  # the fixed sketch's seed: any constant, the same on every peer
FP16 = Cast(torch.float16)


@functools.lru_cache(maxsize=32)
def _sketch(cols: int, width: int) -> torch.Tensor:
    """The fixed Gaussian start of the range finder, per shape (cached: it is drawn per message).
    No entry is zero, so a non-finite input value makes its row of M S non-finite (`factorize`)."""
    sketch = torch.randn((cols, width), generator=torch.Generator().manual_seed(_SEED))
    return sketch.masked_fill_(sketch == 0, 1.0)


def _start(cols: int, width: int, warm: torch.Tensor | None) -> torch.Tensor:
    """The range finder's start [cols, width]: the fixed sketch, or, warm, the `warm` directions
    [k, cols] (orthonormal rows, the top first) in its first min(k, width) columns and the sketch's
    own columns after them, so the oversampled width stays what it is cold."""
    sketch = _sketch(cols, width)
    if warm is None:
        return sketch
    k = min(warm.shape[0], width)
    return torch.cat([warm[:k].T.to(sketch.dtype), sketch[:, k:]], dim=1)


def _orthonormal(y: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(y, mode="reduced").Q


def top_singular(
    m: torch.Tensor, rank: int, start: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The range finder: approximations of the top `rank` singular triplets of a float32 matrix m
    (rows x cols, rank <= min(rows, cols)): left vectors [rows, rank], values [rank], right
    vectors [rank, cols] (orthonormal rows), so m is close to left @ diag(values) @ right.
    `start`: directions [k, cols] (orthonormal rows) to start from instead of the fixed sketch's
    first k columns, with WARM_ITERATIONS power iterations instead of ITERATIONS."""
    rows, cols = m.shape
    width = min(rank + OVERSAMPLE, rows, cols)
    sketched = m @ _start(cols, width, start).to(m.device)
    # checked here, on rows x width values: a pass over m (torch.isfinite) costs half a factorization;
    # a warm start's zero entries hide nothing (0 * inf is NaN)
    if not bool(torch.isfinite(sketched).all()):
        raise ValueError("cannot compress a tensor with NaN or infinite values (or too large for float32)")
    basis = _orthonormal(sketched)
    rounds = ITERATIONS if start is None else WARM_ITERATIONS
    for _ in range(rounds):  # each round sharpens the basis toward the top singular directions
        basis = _orthonormal(m @ _orthonormal(m.T @ basis))
    u, s, vh = torch.linalg.svd(basis.T @ m, full_matrices=False)
    return basis @ u[:, :rank], s[:rank], vh[:rank]


def factorize(m: torch.Tensor, rank: int, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-`rank` factors of a float32 matrix m (rows x cols, rank <= min(rows, cols)): left
    [rank, rows] and right [rank, cols] with left^T @ right close to m's best rank-`rank`
    approximation; `start` as for `top_singular`."""
    vectors, values, right = top_singular(m, rank, start)
    root = values.sqrt()
    return (vectors.T * root[:, None]).contiguous(), (right * root[:, None]).contiguous()


def product(left: torch.Tensor, right: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """left^T @ right (float32 factors [rank, rows] and [rank, cols]) as a tensor of `shape` and
    `dtype`, with values beyond the dtype's range at its largest finite value. One product over the
    rank: the same floats at any thread count (mirrored state on both ends relies on it)."""
    y = left.T @ right
    if dtype in (torch.float16, torch.bfloat16):
        limit = torch.finfo(dtype).max
        y = y.clamp_(-limit, limit)
    return y.to(dtype).reshape(shape)


@dataclass(frozen=True, repr=False)
class LowRank(Codec):
    """Two factors of rank min(`rank`, rows, cols), each through the `factors` value codec.
    `warm`: a link's sender starts from its last delivered message (`swarm.compression.warm`);
    this codec alone, as receivers and evaluation run it, is the cold, stateless one."""

    rank: int
    factors: ValueCodec = FP16
    warm: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"low rank must be a positive integer, got {self.rank}")
        if isinstance(self.factors, Quantize) and self.factors.stochastic:
            raise ValueError("low-rank factors take round-to-nearest quantization (stochastic is not deterministic)")

    @property
    def spec(self) -> str:
        tail = "" if self.factors == FP16 else f"/{inner_spec(self.factors)}"
        return f"lowrank:{self.rank}{tail}{'/warm' if self.warm else ''}"

    def rank_for(self, shape: tuple[int, ...]) -> int:
        """The rank a tensor of this shape is sent at: `rank`, or less when the matrix is smaller."""
        rows, cols = matrix_of(shape)
        return min(self.rank, rows, cols)

    def encode(self, x: torch.Tensor, reuse=None) -> Encoded:
        return self.message(x)

    def message(self, x: torch.Tensor, start: torch.Tensor | None = None) -> Encoded:
        """x's message, its range finder started from `start` (directions [k, cols]) if given."""
        shape = tuple(x.shape)
        rows, cols = matrix_of(shape)
        rank = self.rank_for(shape)
        m = x.detach().reshape(rows, cols).float()
        if rank == 0:
            left, right = m.new_empty((0, rows)), m.new_empty((0, cols))
        else:
            left, right = factorize(m, rank, start)
        part = LowRankPart(rank, self.factors.values(left), self.factors.values(right))
        return Encoded(shape, x.dtype, part)

    def right_factor(self, enc: Encoded, device=None) -> torch.Tensor:
        """The right factor [rank, cols] of a message this codec `holds`, in float32."""
        part = enc.body
        return self.factors.decode_values(part.right, (part.rank, matrix_of(enc.shape)[1]), torch.float32, device)

    def _holds(self, enc: Encoded) -> bool:
        part = enc.body
        return (
            isinstance(part, LowRankPart)
            and part.rank == self.rank_for(enc.shape)
            and self.factors.holds(part.left)
            and self.factors.holds(part.right)
        )

    def decode(self, enc: Encoded, device=None, reuse=None) -> torch.Tensor:
        if not self._holds(enc):
            raise self._refuse(enc)
        part = enc.body
        rows, _ = matrix_of(enc.shape)
        left = self.factors.decode_values(part.left, (part.rank, rows), torch.float32, device)
        return product(left, self.right_factor(enc, device), enc.shape, enc.dtype)
