"""How a stage computes its forward: the autocast dtype (`train.precision`), activation
checkpointing (`train.checkpoint_activations`) and its random numbers.

Random numbers (dropout masks) come from a generator seeded by (run seed, stage, micro-batch):
a micro-batch draws the same masks whichever process runs its stage, in whatever order, and when
it is retried, so a swarm keeps the losses of one process with dropout too.

Weights, optimizer state and parameter gradients stay float32; under bf16/fp16 autocast a stage's
matrix products run in the lower precision, and its output (what the link's codec sees) has the
dtype the model's last operation gives it. fp16 runs without loss scaling: gradients below fp16's
smallest value (6e-8) flush to zero, so bf16 is the safer choice where the device has it.

Activation checkpointing keeps only each micro-batch's stage input and recomputes the stage's
forward during its backward (with the same random state, so dropout masks repeat): memory per
micro-batch in flight drops to one boundary tensor, for about one more forward of compute. The
recomputation runs with the parameter objects the forward ran with, so an asynchronous schedule's
backward differentiates at its micro-batch's weight version, as without checkpointing.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from swarm.data.base import mix_seed

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def activation_dtypes(precision: str) -> tuple[torch.dtype, ...]:
    """The dtypes a stage's output (the next stage's input) can have: float32, or the autocast
    dtype when the last operation ran in it."""
    lower = DTYPES.get(precision)
    return (torch.float32,) if lower is None else (torch.float32, lower)


def check_precision(precision: str, device: torch.device | str) -> None:
    """One line when `device` cannot autocast to `precision`."""
    if precision not in DTYPES:
        raise ValueError(f"train.precision must be one of {', '.join(DTYPES)}, got {precision!r}")
    dtype = DTYPES[precision]
    if dtype is None:
        return
    device = torch.device(device)
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"train.precision={precision}: {device.type} has no autocast; use fp32")
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bfloat16; use fp16 or fp32"
        )


# The global generators are one per process: stages computing on threads of one process (a peer
# hosting several, the tests' in-process swarms) fork them one at a time. Concurrent get/set of a
# generator's state from two threads can also deadlock inside torch (seen: one waits for the
# generator's mutex holding the GIL, the other holds the mutex freeing a tensor, waiting for the GIL).
RNG_LOCK = threading.RLock()


_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout_p", "dropout_rate")


def stochastic(module: torch.nn.Module) -> bool:
    """Whether `module` draws random numbers in training: dropout layers with p > 0, or the
    functional dropout rates transformers' attention modules keep as attributes. Remembered per
    module (a model's layers do not change during a run)."""
    known = getattr(module, "_hivepipe_stochastic", None)
    if known is None:
        known = any(
            (isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0)
            or any(isinstance(getattr(m, name, None), float) and getattr(m, name) > 0 for name in _DROPOUT_ATTRIBUTES)
            for m in module.modules()
        )
        module._hivepipe_stochastic = known
    return known


class Forward:
    """A stage module's forward under the run's precision, checkpointing and random streams."""

    def __init__(
        self,
        precision: str = "fp32",
        checkpointing: bool = False,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        check_precision(precision, device)
        self.dtype = DTYPES[precision]
        self.checkpointing = checkpointing
        self.device = torch.device(device)
        self.device_type = self.device.type
        self.seed = int(seed)

    @contextlib.contextmanager
    def _random(self, stream: tuple | None):
        """The global generators seeded for `stream` inside, as they were outside."""
        if stream is None:
            yield
            return
        devices = [self.device.index or 0] if self.device_type == "cuda" else []
        with RNG_LOCK, torch.random.fork_rng(devices=devices, device_type=self.device_type if devices else "cuda"):
            torch.manual_seed(mix_seed(self.seed, *stream))
            yield

    def recomputing(self, module: torch.nn.Module):
        """Held around a backward that recomputes a checkpointed forward (it forks the generators too)."""
        return RNG_LOCK if self.checkpointing and stochastic(module) else contextlib.nullcontext()

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def __call__(
        self, module: torch.nn.Module, x: torch.Tensor, training: bool, stream: tuple | None = None
    ) -> torch.Tensor:
        """`stream`: integers naming the micro-batch at this stage (None: the global generators as they
        are). A module that draws no random numbers in training leaves the generators alone."""
        if not (training and stochastic(module)):
            stream = None
        with self._random(stream), self.autocast():
            if self.checkpointing and training:
                # the recomputation in the backward runs with the parameter objects of this forward:
                # by then a swarm's asynchronous stage may have newer ones in the module (weight
                # stashing: swarm.engine.stage `_stash`; a step's own: swarm.engine.versions)
                weights = dict(module.named_parameters(remove_duplicate=False))
                return checkpoint(_with_weights, module, weights, x, use_reentrant=False)
            return module(x)


def _with_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return functional_call(module, weights, (x,))
