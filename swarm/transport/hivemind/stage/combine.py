"""The step's gather round on a stage peer: its micro-batches' gradients summed, then brought together
with the peers that share them, among themselves (swarm.transport.hivemind.stage.averaging), never
through the trainer.

The trainer names the groups in the request (`pb.AverageGroup`): the replicas of a stage sum every
parameter's gradient exactly (`_exact`: the same bits however they split the step's micro-batches,
on the step's grid the trainer sends with the group: stage.replicasum), so each holds the stage's whole; then the two stages of a tied parameter
(GPT-2's embedding and LM head) add their wholes of it, one peer of each stage contributing and
every peer of both in the group, so each copy gets the whole sum, as one process's two. A
peer that joined mid-run and is catching up takes part without contributing: it keeps the sums
and sets them when it replays the step (swarm.transport.hivemind.stage.joining). Each tensor
travels with a presence flag: a parameter none of the group had a gradient for stays without one,
as in one process. Of a tied pair, one stage leaves the tied parameter out of its squared norm
(`uncounted`), so clipping counts it once.

An asynchronous step (swarm.engine.delay) closing by a round asks its `held` form: the norm of the
held gradients' sum, no p.grad touched (the step before may not be applied yet). A replicated
stage's peers sum the micro-batches each ran, then those among themselves, and keep the whole as
the step's gradients until its decision applies them (`StageRuntime.hold_combined`).
"""

from __future__ import annotations

import torch

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.engine.exactsum import trained_names
from swarm.engine.microbatch import Mode
from swarm.transport.hivemind.net.meta import tensors_to_payload
from swarm.transport.hivemind.stage.averaging import AveragingError
from swarm.transport.hivemind.stage.replicasum import ROUNDS, ReplicaSum
from swarm.transport.hivemind.stage.state import PeerServices, StagePlace, StageState
from swarm.transport.hivemind.stage.work import StageWork


class Combining:
    """The gather round of one hosted stage (`peer`: its server's averager sums with the others)."""

    def __init__(self, place: StagePlace, state: StageState, work: StageWork, peer: PeerServices) -> None:
        self.place, self.state, self.work, self.peer = place, state, work, peer
        self.uncounted: list[str] = []  # tied parameters this stage leaves out of its squared norm

    async def gather(self, head: pb.GatherRequest) -> tuple[pb.GatherReply, bytes]:
        if head.held:  # an asynchronous step closing by a round (trainer.closing): its norm, p.grad untouched
            return await self._held(head), b""
        groups = list(head.groups)
        await self.before_sums(groups, self._local, head)
        replicas = [group for group in groups if not group.names]
        tied = [group for group in groups if group.names]
        joining = self.state.joining is not None
        tied_names = [name for group in tied for name in group.names]
        if replicas:  # every parameter that trains, tied ones too: each peer then holds the stage's whole
            try:
                sums = await self._exact(head, replicas[0], self._names(replicas[0], set()), groups)
            except AveragingError as e:
                self._refuse(tied)
                raise self._group_failed(e) from None
        else:
            sums = {} if joining else self.state.runtime.gradients(tied_names)
        totals, uncounted = await self._tie(tied, sums)
        await self.work.run(self.work.timed, self._set, head, {**sums, **totals}, uncounted)
        return pb.GatherReply(), b""

    async def _tie(self, tied: list[pb.AverageGroup], sums: dict[str, torch.Tensor]) -> tuple[dict, set[str]]:
        """A tied parameter's groups add both stages' wholes `sums` (one peer per stage contributes:
        the trainer's `groups(held=True)`), as one process adds its two copies (swarm.engine.step
        `tie`); the totals, and the tied parameters this stage leaves out of its squared norm."""
        totals: dict[str, torch.Tensor] = {}
        uncounted: set[str] = set()
        for group in tied:
            names = list(group.names)
            try:
                total = await self.sum(group, self._packed(names, sums))
            except AveragingError as e:
                raise self._group_failed(e) from None
            totals.update(self._unpacked(names, total))
            uncounted.update(() if group.counted else names)
        return totals, uncounted

    async def before_sums(self, groups, fn, *args):
        """`fn(*args)` on the computing thread. When it raises, this peer will not join `groups`:
        their other members' sums fail at once instead of waiting out the all-reduce's timeout for
        it, so the trainer hears the reason (STALE: it runs those micro-batches again) within the round."""
        try:
            return await self.work.run(self.work.timed, fn, *args)
        except BaseException:
            self._refuse(groups)
            raise

    def _refuse(self, groups) -> None:
        if self.peer.averager is not None:
            for group in groups:
                self.peer.averager.refuse(group.group_id)
                for round_id in ROUNDS:
                    self.peer.averager.refuse(group.group_id + round_id)

    def _check_held(self, head: pb.GatherRequest) -> None:
        """Raises STALE, naming them, unless every micro-batch the gather counts here is held, of
        the attempt it names (swarm.transport.hivemind.stage.attempts): the trainer runs those again."""
        indices = list(head.micro_batches)
        held = self.state.runtime.held
        stale = {s.index: s for s in self.state.attempts.stale(head.step, indices, list(head.attempts))}
        for i in indices:
            if (Mode.TRAIN.value, head.step, i) not in held:
                stale.setdefault(i, pb.StaleMicroBatch(index=i))
        if stale:
            shown = ", ".join(map(str, sorted(stale)[:8]))
            raise RemoteError(
                f"stage {self.place.stage}: micro-batch(es) {shown} of step {head.step} are not held here as the attempts the trainer counted",
                pb.STALE,
                stale=[stale[i] for i in sorted(stale)],
            )

    async def _held(self, head: pb.GatherRequest) -> pb.GatherReply:
        """The squared norm of the sum of the step's held gradients, with every p.grad left alone (the
        step before may not be applied yet: swarm.engine.delay), and the rate the step ran at here.
        A replicated stage's peers (a group without names: its replicas) each sum the micro-batches
        it ran, then those sums among themselves, and keep the whole as the step's (`hold_combined`).
        Then a tied parameter's groups (with names) add both stages' wholes, corrected as applied,
        as one process ties them after its delay correction (swarm.engine.step `tie`); one peer
        per stage contributes, and every peer keeps the total until the step applies
        (`StageState.keep_tied`). Its decision applies what was counted (`StageState.counted`)."""
        if self.state.joining is not None:
            self._refuse(head.groups)
            raise RemoteError(f"stage {self.place.stage} peer is still joining: it holds no gradients", pb.UNAVAILABLE)
        replicas = [group for group in head.groups if not group.names]
        tied = [group for group in head.groups if group.names]
        sums = await self.before_sums(head.groups, self._held_local, head, not replicas)
        if replicas:
            names = self._names(replicas[0], set())  # every parameter that trains, tied ones too
            try:
                sums = await self._exact(head, replicas[0], names, head.groups)
            except AveragingError as e:
                self._refuse(tied)
                raise self._group_failed(e) from None
            sums = await self.before_sums(tied, self._whole, int(head.step), sums)
        totals, uncounted = await self._tie(tied, sums)
        return await self.work.run(self.work.timed, self._held_reply, head, {**sums, **totals}, totals, uncounted)

    def _held_local(self, head: pb.GatherRequest, alone: bool) -> dict[str, torch.Tensor]:
        """On the computing thread: the sum of the held gradients the round counts here, corrected
        as applied; a replica's part is summed with its replicas' instead (`_exact`; dc compensates
        the replicas' whole sum: `_whole`)."""
        self._check_held(head)
        return self.state.runtime.held_sum(_keys(head)) if alone else {}

    async def _exact(
        self, head: pb.GatherRequest, group: pb.AverageGroup, names: list[str], refused
    ) -> dict[str, torch.Tensor]:
        """The replicas' exact sum of the held gradients the round counts (stage.replicasum)."""
        return await ReplicaSum(self, group, names, _keys(head), refused).run()

    def _whole(self, step: int, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The replicas' sum kept as the step's, and returned as it applies (in the parameters'
        dtype, with a delay correction's part)."""
        runtime = self.state.runtime
        runtime.hold_combined(step, sums)
        return runtime.combined_grads(step)

    def _held_reply(
        self,
        head: pb.GatherRequest,
        sums: dict[str, torch.Tensor],
        totals: dict[str, torch.Tensor],
        uncounted: set[str],
    ) -> pb.GatherReply:
        state, step = self.state, int(head.step)
        runtime = state.runtime
        square = runtime.sums_sq_norm({name: g for name, g in sums.items() if name not in uncounted})
        state.keep_tied(step, totals)
        state.count(step)
        lr = state.rates.get((state.generation, step), runtime.optimizer.param_groups[0]["lr"])
        return pb.GatherReply(held_sq_norm=square, lr=lr)

    def _names(self, group: pb.AverageGroup, tied: set[str]) -> list[str]:
        if group.names:
            return list(group.names)
        # frozen parameters (a LoRA run's base) never have a gradient: groups sum only what trains,
        # in the order of the exponents each micro-batch reported (the step's grid is merged from them)
        return [name for name in trained_names(self.state.runtime.module) if name not in tied]

    def _local(self, head: pb.GatherRequest) -> None:
        """On the computing thread: the micro-batches' exact sum as this peer's gradients (none while
        joining: it holds no micro-batch)."""
        if self.state.joining is None:
            self._check_held(head)
            self.state.runtime.accumulate(_keys(head))

    def _packed(self, names: list[str], grads: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """A group's tensors (zeros for a parameter without a gradient), with their presence flags last."""
        runtime = self.state.runtime
        tensors = [
            grads[name].detach() if name in grads else torch.zeros_like(runtime.parameter(name)) for name in names
        ]
        return [*tensors, torch.tensor([float(name in grads) for name in names])]

    @staticmethod
    def _unpacked(names: list[str], tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`_packed`'s inverse: the gradients present, by name."""
        present = tensors[-1].tolist()
        return {name: t for name, t, there in zip(names, tensors[:-1], present, strict=True) if there > 0}

    def _group_failed(self, error: AveragingError) -> RemoteError:
        """A group that lost a member: GROUP_FAILED, naming the members it failed on (trainer.blame)."""
        blamed = [peer for peer in error.peers if peer != self.place.peer_id]
        return RemoteError(f"stage {self.place.stage}: {error}", pb.GROUP_FAILED, blamed)

    async def sum(
        self, group: pb.AverageGroup, tensors: list[torch.Tensor], round_id: bytes = b"", integers=()
    ) -> list[torch.Tensor]:
        """The group's sum of `tensors`; `round_id` tells a group's rounds apart (stage.replicasum),
        `integers` flags the tensors that hold integers (ReplicaAverager.sum)."""
        me = self.place.peer_id
        receivers = set(group.receivers)
        contributors = [peer for peer in group.peers if peer not in receivers]
        if list(group.peers) == [me] or not any(t.numel() for t in tensors):
            return tensors  # alone, or nothing to sum (a replicated stage with nothing to train)
        return await self.peer.averager.sum(
            group.group_id + round_id, list(group.peers), tensors, contributors, integers=integers
        )

    def _set(self, head: pb.GatherRequest, combined: dict[str, torch.Tensor], uncounted: set[str]) -> None:
        """On the computing thread: every summed gradient in place (a joiner keeps them to replay)."""
        self.uncounted = list(uncounted)
        joining = self.state.joining
        if joining is not None:
            slots, payload = tensors_to_payload(combined)
            joining.keep("set_grads", pb.SetGradsRequest(step=head.step, grads=slots), payload)
            return
        self.state.runtime.set_gradients(combined)

    def grad_sq_norm(self) -> float:
        """The stage's squared gradient norm, tied parameters counted by one of their stages only."""
        total = 0.0
        for name, param in self.state.runtime.module.named_parameters():
            if param.grad is not None and name not in self.uncounted:
                total += float(param.grad.detach().float().pow(2).sum())
        return total


def _keys(head: pb.GatherRequest) -> list[tuple]:
    """The held gradients a gather counts, in index order (the sums are one process's)."""
    return [(Mode.TRAIN.value, head.step, i) for i in sorted(head.micro_batches)]
