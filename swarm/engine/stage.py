"""A stage runtime: one stage's module and optimizer, driven by messages.

`forward` and `backward` each take one incoming message and the link ends to decode and encode
it with (`LinkEnds`, chosen by the transport per call), and return the next message; they never
deliver anything themselves, so the same runtime serves the in-process transport and the
hivemind one. Both transports parse the bytes they receive at their edge (`protocols.wire.decode`,
with their own limits): the runtime takes `Encoded` messages only. Receiver-side compression state
commits when the stage has processed a message; sender-side state commits through
`Message.delivered` once the transport has delivered it.

Each micro-batch's parameter gradients are kept apart until the step says which count
(`accumulate`; one process: all): one retried after a failure never counts twice. They are summed
exactly (swarm.engine.exactsum): the same bits however replicas split them, and one process's.

With an asynchronous schedule in a swarm (swarm.engine.delay), a stage applies an update while
micro-batches of the step before are still waiting for their backward here, or for their forward
(they come from another sender): every update goes to fresh Parameter objects and the replaced ones
stay the step's version (swarm.engine.stash: PipeDream-2BW's weight stashing); each forward
remembers the objects it used, and gradients are held by parameter name.
A delay correction's per-step weights (lookahead's predicted ones, dc's v_then) are `versions`'
(swarm.engine.versions).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from protocols.errors import PayloadError
from protocols.message import Encoded
from swarm.engine.delay import StageDelay
from swarm.engine.digest import gradient_digest
from swarm.engine.diverged import require_finite
from swarm.engine.exactsum import exact_sum, integer_sums, step_codes
from swarm.engine.linkend import LinkEnds
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.engine.precision import Forward
from swarm.engine.stageparts import Objective, TrainedModule
from swarm.engine.stash import WeightStash
from swarm.engine.versions import StepVersions


class StageRuntime:
    def __init__(
        self,
        index: int,
        num_stages: int,
        trained: TrainedModule,
        objective: Objective | None = None,
        device: torch.device | str = "cpu",
        hold_grads: bool = False,
        run_forward: Forward | None = None,
    ) -> None:
        """`objective`: the last stage's loss and metrics (the other stages have none)."""
        self.index = index
        self.num_stages = num_stages
        self.module, self.optimizer, self.scheduler = trained.module, trained.optimizer, trained.scheduler
        self.loss_fn = objective.loss if objective is not None else None
        self.metrics_fn = objective.metrics if objective is not None else None
        self.device = torch.device(device)
        # micro-batch key -> (input, output, the (name, parameter) pairs its forward ran with)
        self._saved: dict[tuple, tuple[torch.Tensor, torch.Tensor, list]] = {}
        self.hold_grads = hold_grads  # a swarm's stage: two steps may be open at once (build: versions)
        self.held: dict[tuple, list[tuple[str, torch.Tensor]]] = {}  # by parameter name: swarm.engine.stash
        self.run_forward = run_forward or Forward(device=self.device)
        self.delay: StageDelay | None = None  # train.schedule async: the last step's gradients (swarm.engine.delay)
        self.versions: StepVersions | None = None  # ... and, in a swarm, a correction's weights per step
        # an asynchronous step of a replicated stage in a swarm: step -> its replicas' sum, the step's
        # gradients here whatever micro-batches this peer ran (`hold_combined`)
        self.combined: dict[int, dict[str, torch.Tensor]] = {}
        self.stash = WeightStash()  # the version the step before the current one runs at (a swarm's async)
        # what the loss takes as targets (swarm.models.base.Targets; None: not known): a transport
        # checks a received micro-batch's against it where it decodes them, before any model sees them
        self.targets = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    # ---- forward ---------------------------------------------------------------------------

    def _input(
        self, batch: MicroBatch, payload: torch.Tensor | Encoded, ends: LinkEnds
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        batch.check_input(payload.shape)  # a message's shape before anything is decoded
        if self.first:
            return payload.to(self.device), lambda: None
        incoming = ends.inbound.receive(batch, payload, self.device)
        return incoming.tensor, incoming.commit

    def forward(self, batch: MicroBatch, payload: torch.Tensor | Encoded, ends: LinkEnds) -> Message:
        """Stage 0 gets the input tensor, later stages their boundary's message."""
        x, commit_received = self._input(batch, payload, ends)
        training = batch.mode is Mode.TRAIN
        self.module.train(training)
        if training and not self.first:
            x = x.detach().requires_grad_(True)
        # a swarm's delay correction: the step's weights (lookahead's predicted ones, which `_trained`
        # then names and the last stage's backward differentiates at)
        version = (
            self.versions.running(batch.step, self.module) if self.versions is not None and training else nullcontext()
        )
        with self.stash.running(batch.step) if training else nullcontext(), version:
            with torch.set_grad_enabled(training):
                stream = (self.index, batch.step, batch.index) if training else None
                y = self.run_forward(self.module, x, training, stream)
            if self.last:
                message = self._finish(batch, x, y, ends)
            else:
                require_finite(y, self.index, "activations are", batch)  # before it is kept or sent
                if training:
                    self._saved[batch.key] = (x, y, self._trained())
                out = ends.outbound.send(batch, y.detach())
                message = Message(Kind.FORWARD, self.index + 1, batch, out.payload, delivered=out.commit)
        commit_received()
        return message

    def _finish(self, batch: MicroBatch, x: torch.Tensor, logits: torch.Tensor, ends: LinkEnds) -> Message:
        targets = batch.targets.to(self.device)
        with torch.no_grad():
            metrics = dict(self.metrics_fn(logits.detach(), targets)) if self.metrics_fn else {}
        if batch.mode is Mode.EVAL:
            return Message(Kind.DONE, -1, batch, metrics=metrics)
        loss = self.loss_fn(logits, targets)
        require_finite(loss.detach(), self.index, "loss is", batch)
        metrics["loss"] = float(loss.detach())
        x_grad = self._backprop(batch, loss * batch.weight, None, x, self._trained())
        return self._gradient_message(batch, x, x_grad, ends, metrics)

    # ---- backward --------------------------------------------------------------------------

    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]

    def _backprop(
        self, batch: MicroBatch, output: torch.Tensor, grad_output: torch.Tensor | None, x: torch.Tensor, trained
    ) -> torch.Tensor | None:
        """Backward through this stage; the input's gradient (None for stage 0's input)."""
        if not output.requires_grad:  # nothing up to here trains (a LoRA run's frozen embedding stage)
            self.held[batch.key] = []
            return None
        params = [p for _, p in trained]  # the objects the forward ran with (a newer version may be current)
        wants_x = x.requires_grad
        with self.run_forward.recomputing(self.module):
            grads = torch.autograd.grad(output, [*params, x] if wants_x else params, grad_output, allow_unused=True)
        self.held[batch.key] = [(name, g) for (name, _), g in zip(trained, grads, strict=False) if g is not None]
        return grads[-1] if wants_x else None

    def held_digest(self, key, exact: bool = True) -> float:
        """`digest.gradient_digest` of the gradients held for micro-batch `key` (verification's)."""
        return gradient_digest(self.held.get(key, []), exact)

    def accumulate(self, keys) -> None:
        """Gradients := the sum of the held gradients of `keys`, in the given order.

        Repeatable (held gradients stay until `apply_step`), so a step whose micro-batches had to
        be re-run can accumulate again. Raises KeyError, before touching anything, if a key is not held."""
        sums = self._summed(keys)
        for name, p in self.module.named_parameters():
            p.grad = sums.get(name)

    def accumulate_held(self) -> None:
        """One process's step: gradients := the exact sum of every held gradient, then forgotten."""
        self.accumulate(sorted(self.held))
        self.held.clear()

    def accumulate_step(self, step: int, count: int) -> None:
        """`accumulate` of an asynchronous step's `count` micro-batches, or its replicas' sum where
        one was combined (the micro-batches this peer held are only part of it)."""
        combined = self.combined.get(step)
        if combined is None:
            self.accumulate(step_keys(step, count))
            return
        sums = self.combined_grads(step)
        for name, p in self.module.named_parameters():
            p.grad = sums.get(name)

    def combined_grads(self, step: int) -> dict[str, torch.Tensor]:
        """The replicas' sum of `step` as it applies now: copies (an apply that fails keeps the sum),
        with a delay correction's part at the current weights (on the whole sum, as one process's)."""
        sums = {name: g.clone() for name, g in self.combined[step].items()}
        return sums if self.versions is None else self.versions.corrected(step, self.module, sums)

    def held_sum(self, keys, corrected: bool = True) -> dict[str, torch.Tensor]:
        """`_summed`, leaving every p.grad alone. Raises KeyError if a key is not held."""
        return self._summed(keys, corrected)

    def hold_combined(self, step: int, sums: dict[str, torch.Tensor]) -> None:
        """`sums`, the replicas' sum of an asynchronous step (as computed: a delay correction's part
        comes when it applies, `combined_grads`), are its gradients here until applied; the held
        gradients of its micro-batches stay (a round that fails sums them again) and go with it."""
        params = dict(self.module.named_parameters())
        self.combined = {s: v for s, v in self.combined.items() if s > step - 2}  # two steps open at most
        self.combined[step] = {name: g.to(params[name].device, params[name].dtype) for name, g in sums.items()}

    def held_sq_norm(self, keys) -> float:
        """`grad_sq_norm` after `accumulate(keys)`, the same floats, leaving every p.grad alone: an
        asynchronous schedule's step is summed while an earlier one is not applied yet. Raises
        KeyError if a key is not held."""
        return self.sums_sq_norm(self._summed(keys))

    def sums_sq_norm(self, sums: dict[str, torch.Tensor]) -> float:
        """`grad_sq_norm` of gradients `sums` by name, in the same order (the same floats)."""
        total = 0.0
        for name, _ in self.module.named_parameters():  # grad_sq_norm's order
            if name in sums:
                total += float(sums[name].detach().float().pow(2).sum())
        return total

    def held_kept(self, step: int, count: int) -> dict[str, torch.Tensor] | None:
        """An asynchronous step's held gradients as one process keeps them (`StageDelay.kept`: the
        sum of the step's `count` micro-batches, in index order, the same floats), so that a swarm's
        checkpoint or copy is one process's; None when none of them is held (no step ran yet)."""
        if step in self.combined:  # a replicated stage's: its replicas' sum
            return {name: g.clone() for name, g in self.combined[step].items()}
        keys = step_keys(step, count)
        if not any(key in self.held for key in keys):
            return None
        return self._summed(keys, corrected=False)

    def hold_kept(self, step: int, count: int, kept: dict[str, torch.Tensor] | None) -> None:
        """The inverse of `held_kept`: all of `kept` held as the step's first micro-batch's, nothing
        as the others' (summing them gives `kept`, the same floats), so the step is applied and its
        norm taken as if its micro-batches had just run here."""
        if kept is None:
            return
        first, *others = step_keys(step, count)
        self.held[first] = list(kept.items())
        for key in others:
            self.held[key] = []

    def _summed(self, keys, corrected: bool = True) -> dict[str, torch.Tensor]:
        """Parameter name -> the sum of its held gradients of `keys`, added in the given order (and,
        in a swarm with a delay correction, `corrected` as if applied now: `versions`; one process's
        kept gradients are the raw sums)."""
        sums = exact_sum(self._held_terms(keys))
        if corrected and self.versions is not None and keys:
            sums = self.versions.corrected(keys[0][1], self.module, sums)  # a key is (mode, step, index)
        return sums

    def _held_terms(self, keys) -> list[list[tuple[str, torch.Tensor]]]:
        if missing := [key for key in keys if key not in self.held]:
            raise KeyError(f"stage {self.index} holds no gradients for micro-batch(es) {missing}")
        return [self.held[key] for key in keys]

    def held_codes(self, keys, names) -> tuple[list[int], list[int]]:
        """The exact sum's grid of the held gradients of `keys` over `names`, and how many hold each
        (exactsum.merged_codes; replicas check or merge theirs). KeyError if a key is not held."""
        codes, counts, _ = step_codes(self._held_terms(keys), names)
        return codes, counts

    def held_integers(self, keys, grid: dict[str, int], single: set[str]) -> dict[str, torch.Tensor]:
        """What replicas add up: the held gradients of `keys` as integers on `grid` (exactsum.integer_sums)."""
        return integer_sums(self._held_terms(keys), grid, single)

    def _gradient_message(
        self,
        batch: MicroBatch,
        x: torch.Tensor,
        x_grad: torch.Tensor | None,
        ends: LinkEnds,
        metrics: dict | None = None,
    ) -> Message:
        """Where the gradient goes next; `metrics` (the loss) ride along to stage 0."""
        if self.first:
            return Message(Kind.DONE, -1, batch, metrics=metrics or {})
        grad = x_grad if x_grad is not None else torch.zeros_like(x)
        require_finite(grad, self.index, "input gradients are", batch)
        out = ends.inbound.send(batch, grad)
        return Message(Kind.BACKWARD, self.index - 1, batch, out.payload, metrics=metrics or {}, delivered=out.commit)

    def backward(self, batch: MicroBatch, payload: Encoded, metrics: dict | None, ends: LinkEnds) -> Message:
        saved = self._saved.pop(batch.key, None)
        if saved is None:
            raise KeyError(f"stage {self.index} has no forward state for micro-batch {batch.key}")
        x, y, trained = saved
        if tuple(payload.shape) != tuple(y.shape):  # else autograd's error, from deep inside torch
            raise PayloadError(
                f"micro-batch {batch.key}: gradient of shape {payload.shape} for output {tuple(y.shape)}"
            )
        incoming = ends.outbound.receive(batch, payload, self.device)
        x_grad = self._backprop(batch, y, incoming.tensor.to(y.dtype), x, trained)
        message = self._gradient_message(batch, x, x_grad, ends, metrics)
        incoming.commit()
        return message

    def activations(self, batch: MicroBatch) -> torch.Tensor:
        """The output a training micro-batch's forward sent on (to encode it again for another link)."""
        saved = self._saved.get(batch.key)
        if saved is None:
            raise KeyError(f"stage {self.index} holds no activations of micro-batch {batch.key}")
        return saved[1].detach()

    def drop(self, batch: MicroBatch, ends: LinkEnds) -> None:
        """Forget a micro-batch that failed somewhere in the pipeline."""
        self._saved.pop(batch.key, None)
        self.held.pop(batch.key, None)
        for end in ends:
            if end is not None:
                end.forget(batch)

    def clear(self) -> None:
        """Forget every micro-batch in flight and every held gradient (a checkpoint was loaded)."""
        self._saved.clear()
        self.held.clear()
        self.combined.clear()
        self.stash.forget()
        if self.versions is not None:
            self.versions.forget()

    # ---- optimizer -------------------------------------------------------------------------

    def grad_sq_norm(self) -> float:
        total = 0.0
        for p in self.module.parameters():
            if p.grad is not None:
                total += float(p.grad.detach().float().pow(2).sum())
        return total

    def gradients(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The gradients of the parameters `names` (all when None); parameters without one are left out."""
        if names is None:
            names = [name for name, _ in self.module.named_parameters()]
        grads = {}
        for name in names:
            grad = self.parameter(name).grad
            if grad is not None:
                grads[name] = grad.detach()
        return grads

    def set_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """Replaces these parameters' gradients (copies); checks every name and shape first."""
        params = {name: self.parameter(name) for name in grads}
        for name, grad in grads.items():
            if tuple(grad.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"gradient for {name!r} has shape {tuple(grad.shape)}, the parameter {tuple(params[name].shape)}"
                )
        for name, grad in grads.items():
            params[name].grad = grad.to(params[name].device, params[name].dtype, copy=True)

    def parameter(self, name: str) -> torch.nn.Parameter:
        try:
            return self.module.get_parameter(name)
        except AttributeError:
            raise KeyError(f"stage {self.index} has no parameter {name!r}") from None

    def scale_grads(self, factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def apply_step(self, keys=None) -> float:
        """Optimizer and schedule step; returns the learning rate used. `keys`: the micro-batches
        whose held gradients it applied (an asynchronous schedule's step; later steps' stay held),
        else every held gradient goes."""
        lr = self.optimizer.param_groups[0]["lr"]
        if self.delay is not None and keys:  # a swarm's: step t - 1 applied, the objects stay step t's
            self.stash.renew(self.module, self.optimizer, keys[0][1] + 1)
        elif self.delay is not None and self._saved:
            self.stash.renew(self.module, self.optimizer, -1)  # kept alive by the saved graphs only
        late = self.versions is not None and bool(keys)  # a swarm's step applied late: its correction's part
        if late:
            self.versions.updating(
                self.module, [name for name, p in self.module.named_parameters() if p.grad is not None]
            )
        self.optimizer.step()
        if late:
            self.versions.applied(keys[0][1], self.module)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if keys is None:
            self.held.clear()
        else:
            for key in keys:
                self.held.pop(key, None)
            if keys:
                self.combined.pop(keys[0][1], None)  # a key is (mode, step, index)
        return lr

    @property
    def pending(self) -> int:
        return len(self._saved)


def step_keys(step: int, count: int) -> list[tuple]:
    """The keys of a step's `count` training micro-batches, in index order."""
    return [(Mode.TRAIN.value, step, i) for i in range(count)]
