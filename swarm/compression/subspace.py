"""`subspace:R`: a tensor sent as its coordinates in a rank-R basis both ends of a link hold.

For [tokens x hidden] boundaries, as `lowrank`: the tensor is a matrix M, rows x cols (cols its
last dimension). Both ends hold the same basis B, R orthonormal directions of the cols-space, and a
message carries only the coefficients C = M B^T (rows x R, in the chosen format: fp16 by default,
bf16, fp32 or k-bit per component); the receiver decodes M^ = C B. A message costs about R / cols
of the tensor's elements, against R (rows + cols) / (rows cols) for `lowrank:R`: the right factor
is paid once per basis instead of once per message.

Where the basis comes from: the SENDER finds it, with lowrank's range finder (the top R right
singular directions of the tensor it is sending), when the link has none yet or its basis has
served `every` messages (`/everyK`, default 32), and puts it in that message (fp16; fp32 with fp32
coefficients). Both ends install the basis decoded from those bytes when the message is delivered,
the sender decoding its own bytes, so the two bases are bit-identical. Neither end derives a basis
from its reconstructions on its own: SVDs and matrix products do not give bit-identical floats on
different machines, BLAS builds, thread counts or devices, so independently computed bases would
drift apart and every later message would be decoded in a basis it was not encoded in, silently.
Taking the basis from the model (Protocol Models, arXiv 2506.01260, constrains a layer's outputs
to a subspace) is not built: that changes the model being trained, not the link; this codec sends
any model's tensors.

The basis is link state mirrored on both ends, like EF21's buffers (`swarm.compression.basis`:
versions, commit on delivery, reset, checkpoints). This module is the stateless math: the plain
`Subspace` codec sends and reads standalone messages (basis version 0: their own basis, no link
state), which evaluation uses; a link end's codec is `basis.LinkSubspace(Subspace(...))`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.errors import PayloadError
from protocols.message import Encoded, QuantPart, RawPart, SubspacePart
from protocols.wire import matrix_of
from swarm.compression.codecs import Cast, Codec, Quantize, ValueCodec, inner_spec
from swarm.compression.lowrank import FP16, product, top_singular

# Messages per basis. A refresh message carries R x cols basis values on top of its coefficients:
# spread over 32 messages, 2.3% more bytes at [1024 tokens x 768] (0.3% at 8 x 1024 tokens), while
# activations drift little in 32 micro-batches (a step or a few) of training.
DEFAULT_EVERY = 32
FP32 = Cast(torch.float32)


@dataclass(frozen=True, repr=False)
class Subspace(Codec):
    """Coefficients in a rank min(`rank`, rows, cols) basis, through the `coefficients` value codec."""

    rank: int
    coefficients: ValueCodec = FP16
    every: int = DEFAULT_EVERY

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"subspace rank must be a positive integer, got {self.rank}")
        if self.every < 1:
            raise ValueError(f"a subspace basis serves at least one message, got every {self.every}")
        if isinstance(self.coefficients, Quantize) and self.coefficients.stochastic:
            raise ValueError(
                "subspace coefficients take round-to-nearest quantization (stochastic is not deterministic)"
            )

    @property
    def spec(self) -> str:
        tail = "" if self.coefficients == FP16 else f"/{inner_spec(self.coefficients)}"
        every = "" if self.every == DEFAULT_EVERY else f"/every{self.every}"
        return f"subspace:{self.rank}{tail}{every}"

    @property
    def basis_codec(self) -> Cast:
        """How a basis travels: fp16 (its entries lie in [-1, 1], and it is paid once per `every`
        messages), fp32 when the coefficients are fp32 (the basis then limits no more than they do)."""
        return FP32 if self.coefficients == FP32 else FP16

    def rank_for(self, shape: tuple[int, ...]) -> int:
        """The rank of a basis found from a tensor of this shape."""
        rows, cols = matrix_of(shape)
        return min(self.rank, rows, cols)

    # -- the math: a fresh basis, coefficients, the product ---------------------------------

    def fresh_basis(self, m: torch.Tensor, rank: int) -> tuple[RawPart, torch.Tensor]:
        """The top `rank` right singular directions of m as wire values, and the float32 basis
        [rank, cols] both ends will hold: decoded from those values, not the range finder's floats."""
        _, _, right = top_singular(m, rank)
        part = self.basis_codec.values(right)
        return part, self.read_basis(part, rank, m.shape[1], m.device)

    def read_basis(self, part: RawPart, rank: int, cols: int, device=None) -> torch.Tensor:
        return self.basis_codec.decode_values(part, (rank, cols), torch.float32, device)

    def message(self, x: torch.Tensor, m: torch.Tensor, basis: torch.Tensor, version: int, basis_part=None) -> Encoded:
        """The message of x (as the float32 matrix m) in `basis` [rank, cols], of `version`,
        carrying `basis_part` when it installs a basis."""
        coefficients = basis @ m.T  # [rank, rows]: one row per component, as lowrank's left factor
        # checked here, on rank x rows values: every non-finite input value reaches them (a refresh's
        # range finder has checked already), unless a basis column is zero there
        if not bool(torch.isfinite(coefficients).all()):
            raise ValueError("cannot compress a tensor with NaN or infinite values (or too large for float32)")
        part = SubspacePart(basis.shape[0], version, self.coefficients.values(coefficients), basis_part)
        return Encoded(tuple(x.shape), x.dtype, part)

    def matrix(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = matrix_of(tuple(x.shape))
        return x.detach().reshape(rows, cols).float()

    def holds(self, enc: Encoded) -> bool:
        """Whether `enc` is a subspace payload in this codec's formats."""
        part = enc.body
        return (
            isinstance(part, SubspacePart)
            and self.coefficients.holds(part.coefficients)
            and (part.basis is None or (not isinstance(part.basis, QuantPart) and self.basis_codec.holds(part.basis)))
        )

    def reconstruct(self, enc: Encoded, basis: torch.Tensor, device=None) -> torch.Tensor:
        part = enc.body
        rows, _ = matrix_of(enc.shape)
        coefficients = self.coefficients.decode_values(part.coefficients, (part.rank, rows), torch.float32, device)
        return product(coefficients, basis.to(device), enc.shape, enc.dtype)

    # -- standalone messages (version 0): their own basis, no link state ----------------------

    def encode(self, x: torch.Tensor, reuse=None) -> Encoded:
        m = self.matrix(x)
        rank = self.rank_for(tuple(x.shape))
        if rank == 0:  # an empty matrix: nothing to find
            part = self.basis_codec.values(m.new_empty((0, m.shape[1])))
            return self.message(x, m, m.new_empty((0, m.shape[1])), 0, part)
        part, basis = self.fresh_basis(m, rank)
        return self.message(x, m, basis, 0, part)

    def decode(self, enc: Encoded, device=None, reuse=None) -> torch.Tensor:
        if not self.holds(enc):
            raise self._refuse(enc)
        part = enc.body
        if part.basis_version != 0 or part.basis is None:
            raise self._refuse_stateful(enc)
        return self.reconstruct(enc, self.read_basis(part.basis, part.rank, matrix_of(enc.shape)[1], device), device)

    def _refuse_stateful(self, enc: Encoded) -> PayloadError:
        return PayloadError(
            f"a subspace payload in basis version {enc.body.basis_version} needs the link's basis (this end keeps none)"
        )
