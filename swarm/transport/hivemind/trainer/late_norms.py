"""dc in a swarm (swarm.engine.versions): a step's decision waits for norms that come a step late.

The gradients clipping must see are step t's compensated at v_{t+1}, the weights they are applied
to, which a stage has once step t - 1 is applied there: their norms come back with step t + 1's
first micro-batch (stage.closing's `LATE`), after the loop closed step t. So the loop's `close`
leaves step t waiting here, the reply that brings its last norm decides it, and step t + 2's
micro-batches, which bring the decision, wait for it (`ready`) before they go out: one
micro-batch's round trip after step t + 1's first, about what a decision without dc waits for
(step t's last micro-batch). Everything here runs on the trainer's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from protocols.wire_names import LATE


class LateDecisions:
    def __init__(self, num_stages: int, decide: Callable[[int, dict[int, float], float | None], None]) -> None:
        self.num_stages = num_stages
        self.decide = decide  # (step, stage -> squared norm, grad_clip): the decision made pending
        self.squares: dict[int, dict[int, float]] = {}  # step -> stage -> its norm, as they come
        self.waiting: dict[int, float | None] = {}  # steps the loop closed, undecided -> grad_clip
        self.events: dict[int, asyncio.Event] = {}  # step -> set when decided (what `ready` waits on)

    def heard(self, step: int, ours: dict[str, float]) -> None:
        """A reply of a micro-batch of `step` with these closing metrics: norms of step - 1 among them."""
        for key, value in ours.items():
            if key.startswith(LATE):
                self.squares.setdefault(step - 1, {})[int(key.removeprefix(LATE))] = value
        self._maybe(step - 1)

    async def closed(self, step: int, grad_clip: float | None) -> None:
        """The loop closed `step` (its learning rate known): decided once its norms are all in. The
        step before must be decided by now: its norms came with this step's micro-batches."""
        if step - 1 in self.waiting:
            raise RuntimeError(
                f"step {step - 1} of a train.delay_correction dc run in a swarm got no norms of its compensated gradients from every stage with step {step}'s micro-batches"
            )
        self.waiting[step] = grad_clip
        self.squares = {s: v for s, v in self.squares.items() if s >= step}
        self._maybe(step)

    def _maybe(self, step: int) -> None:
        squares = self.squares.get(step, {})
        if step not in self.waiting or sorted(squares) != list(range(self.num_stages)):
            return
        self._decided(step, squares)

    async def by_round(self, step: int, held: Callable[[int], Awaitable[float]]) -> None:
        """`step`, closed but with its norms not all in (a reply that brought them was lost or
        retried), decided from `held`'s total of every stage's norm instead: a round, which the
        caller makes once every stage's weights are those `step`'s gradients are applied to."""
        if step not in self.waiting:
            return
        total = await held(step)
        if step in self.waiting:  # the norms may have come meanwhile
            self._decided(step, {0: total})

    def _decided(self, step: int, squares: dict[int, float]) -> None:
        self.decide(step, squares, self.waiting.pop(step))
        self.squares.pop(step, None)
        event = self.events.pop(step, None)
        if event is not None:
            event.set()

    async def ready(self, step: int) -> None:
        """Returns once `step` is decided, or when no decision of it is expected."""
        if step in self.waiting:
            await self.events.setdefault(step, asyncio.Event()).wait()

    def forget(self) -> None:
        self.squares, self.waiting = {}, {}
        for event in self.events.values():
            event.set()  # whatever waits goes on (without a decision)
        self.events = {}
