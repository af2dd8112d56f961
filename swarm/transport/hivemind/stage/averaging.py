"""All-reduce of a stage's parameter gradients among the peers that host it (its replicas).

Replicas of a stage used to send their gradients to the trainer, which summed them and sent the
sum back: a star through one process, whose link carries every replica's gradients both ways.
Here the replicas sum among themselves with hivemind's butterfly all-reduce (`AllReduceRunner`:
each member reduces one slice of the tensors for everyone): each of n members sends and receives
2(n-1)/n times the tensors' wire size (float64 here, see `ReplicaAverager.sum`), and no process
is a hub. The trainer names each group (its members, their order, who contributes) every step,
so there is no matchmaking: `DecentralizedAverager`'s DHT group search takes seconds and fails
under churn (hivemind #519, #624).

What this adds to the runner: sums instead of weighted means, the same on every member bit for
bit (`ReplicaAverager.sum`), and all or nothing: hivemind leaves out a member that fails and
finishes with the rest, which would silently train on a smaller sum; here any failure raises
`AveragingError` naming the peer. Every member must run this module's runner for that (below).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import AsyncIterator  # noqa: UP035  ServicerBase reads rpc_* hints with typing's `_name`

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, AllreduceException, TensorPartReducer
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

from protocols.errors import one_line
from swarm.engine.exactsum import recovered
from swarm.transport.hivemind.net.bounded_handler import add_bounded_handlers

AVERAGING_NAMESPACE = "hivepipe.average"  # the p2p handler's namespace: every stage peer's averager
# Tensors travel as float64 (twice float32's bytes) so that a member's result is exact: see `sum`.
WIRE_DTYPE = torch.float64
REMEMBERED_GROUPS = 4096  # finished group ids kept: a late stream for one is refused at once
# Members start a group within a round trip of one another. One the run still waits for after this
# long is dialed (again every as long): a member that only sends to us and died, or refused the
# group, would otherwise cost the whole timeout, as nothing of ours goes to it.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 5.0
# A member's message carries one part (at most DEFAULT_PART_SIZE_BYTES of values, the runner's
# default) and a few fields: anything much longer is not a part, and is refused before it is read.
MAX_PART_MESSAGE_BYTES = 2 * DEFAULT_PART_SIZE_BYTES + (64 << 10)
# A probe's only message (`_dial`): its group id and this code. A member that refused the group
# answers GROUP_DISBANDED; any other ends the stream empty (alive, and not refusing).
PROBE_CODE = averaging_pb2.REQUEST_JOIN


class AveragingError(RuntimeError):
    """A group's all-reduce did not complete with every member; the message names who failed, and
    `peers` (base58) are the members it failed on or was still waiting for."""

    def __init__(self, message: str, peers=()) -> None:
        super().__init__(message)
        self.peers = [str(peer) for peer in peers]


class _Runner(AllReduceRunner):
    """hivemind's runner, made all or nothing, that remembers who failed.

    The stock runner, when a reducer fails, uses our own values for its slice (logged at debug),
    and when a sender fails, bans it and finishes the slice with the others, then sends that slice
    on as if complete: members that only receive it cannot tell. Here the first failure ends the
    run at once, before a reducer can finish any slice without a sender, and a reducer that ends
    this way answers its senders with errors, so the failure reaches every member."""

    def __init__(self, integers: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        if integers:  # the reducer of this member's slice adds in float64: exact for integers below 2^53
            stock = self.tensor_part_reducer
            self.tensor_part_reducer = _Float64Reducer(stock.part_shapes, stock.num_senders)
        self.failed: dict[PeerID, str] = {}  # the first failures, not those that followed from them
        self.reduced_by: set[PeerID] = set()  # reducers whose slices all came back

    def fail(self, peer_id: PeerID, reason: str) -> None:
        if not self._future.done():
            self.failed.setdefault(peer_id, reason)
            self.finalize(exception=AllreduceException(f"{peer_id}: {reason}"))

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        try:
            await super()._communicate_with_peer(peer_id)
            self.reduced_by.add(peer_id)
        except Exception as e:
            self.fail(peer_id, one_line(e))
            raise

    async def _ban_sender(self, peer_id: PeerID) -> None:
        # before super(): its on_sender_failed would complete the slice without this sender
        self.fail(peer_id, "stopped sending its parts" if peer_id in self.active_senders else "sent nothing")
        await super()._ban_sender(peer_id)

    def close(self) -> None:
        """Ends the run if it has not ended (its streams stop) and takes its outcome, which nobody
        awaits: asyncio would log an exception left in it."""
        self.finalize(cancel=True)
        if not self._future.cancelled():
            self._future.exception()

    def waiting_for(self) -> list[PeerID]:
        """Whom a run that timed out was still waiting for: senders of parts for our slice that sent
        nothing, or else reducers of slices that did not come back."""
        if self.failed:
            return list(self.failed)
        mine = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        silent = [p for p in self.sender_peer_ids if p not in self.active_senders]
        if mine and silent:
            return silent
        parts, done = self.tensor_part_container.num_parts_by_peer, self.reduced_by | {self.peer_id}
        return [p for p, n in zip(self.ordered_peer_ids, parts, strict=True) if n and p not in done]


class _Float64Reducer(TensorPartReducer):
    """hivemind's reducer with a float64 accumulator (the stock one is float32, which rounds
    integers past 2^24): an exact sum's integers (swarm.engine.exactsum) add exactly, in any order."""

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if getattr(self, "accumulator", None) is not None:
            self.accumulator = self.accumulator.double()


class ReplicaAverager(ServicerBase):
    """Sums tensors with named groups of peers; one per (run, stage) hosted by a peer.

    Its RPC handler is registered on `p2p` under `namespace` (`ReplicaAverager.rpc_aggregate_part`),
    so the averagers of one (run, stage) find each other by namespace. `timeout_s` bounds a whole
    `sum`, and how long a peer's stream waits for our `sum` of its group to start."""

    def __init__(self, p2p: P2P, namespace: str, timeout_s: float) -> None:
        self.p2p, self.namespace, self.timeout_s = p2p, namespace, timeout_s
        self.peer_id = p2p.peer_id
        self._groups: dict[bytes, asyncio.Future] = {}  # group id -> its runner (pending: a stream came first)
        self._finished: OrderedDict[bytes, None] = OrderedDict()
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # groups this peer will not join (`refuse`)
        self._started = False

    async def start(self) -> None:
        # hivemind's handler would read a message of any declared length (net.bounded_handler)
        await add_bounded_handlers(self, self.p2p, self.namespace, MAX_PART_MESSAGE_BYTES)
        self._started = True

    async def stop(self) -> None:
        """Removes the handler; streams waiting for a group get BAD_GROUP_ID, running sums raise."""
        for slot in list(self._groups.values()):
            if not slot.done():
                slot.set_result(None)
            elif slot.result() is not None:
                slot.result().fail(self.peer_id, "its averager stopped")
        if self._started:
            self._started = False
            with contextlib.suppress(Exception):  # the daemon is gone (its node shut down first): nothing to remove
                await self.remove_p2p_handlers(self.p2p, namespace=self.namespace)

    async def sum(
        self,
        group_id: bytes,
        peers: Sequence[str],
        tensors: Sequence[torch.Tensor],
        contributors: Collection[str] | None = None,
        integers: Sequence[bool] = (),
    ) -> list[torch.Tensor]:
        """The sum of `tensors` over the `contributors` (default: every member) of the group `peers`
        (base58 ids; this peer among them); every member calls with the same arguments but tensors.

        A member not among the contributors (a joiner catching up: it needs the sum but has no
        gradients) sends zeros with weight 0. The reducer adds `weight * part` to its accumulator and
        `weight` to its denominator, so a weight-0 sender changes neither: the runner's mean is
        (sum over contributors) / k, k the number of contributors, and the sum is mean * k.

        Numerics. The reducer accumulates in float32 (its accumulator is `torch.zeros`, the default
        dtype) and divides by k, so the mean is a float32 value; it returns deltas mean - local.
        In float64 that delta is exact (unless the sum cancels below about 2^-29 of a part), so
        every member recovers the same mean and the same sum bit for bit; in float32 about a fifth
        of the elements would be off by an ulp of the part, differently on each member. For k a
        power of two the division and mean * k are exact: two contributors get fl32(a + b), what
        one process gives. Otherwise the reducer adds in the order parts arrive and mean * k rounds
        again: within a few ulps of the parts' magnitudes (tests/transport/hivemind/test_averaging.py).
        Float64 inputs are summed in float32 too, but with `integers` (a flag per tensor): then
        reducers add in float64, and a flagged tensor holds integers whose sum stays below 2^46
        (swarm.engine.exactsum), added exactly and given back as those integers on every member,
        whatever the order (`exactsum.recovered`); an unflagged one is a float32 value and zeros
        (one contributor has it), which comes back as that value. Tensors go to the CPU for the exchange and come back to their own
        device and dtype.

        Raises AveragingError naming the peer(s) when a member fails, or when the group has not
        finished within `timeout_s`; the others may then fail too, or may have finished first.
        `group_id` must be new (callers put step and attempt in it): a used one raises ValueError.
        """
        me = self.peer_id.to_base58()
        contributors = set(peers if contributors is None else contributors)
        if me not in peers or len(set(peers)) != len(peers) or not contributors or not contributors <= set(peers):
            raise ValueError(f"bad group {peers} (contributors {contributors}) for {me}")
        if group_id in self._finished or (group_id in self._groups and self._groups[group_id].done()):
            raise ValueError(f"averaging group {group_id!r} was already used")
        if not tensors:
            return []
        contributes = me in contributors
        local = [
            t.detach().to("cpu", WIRE_DTYPE) if contributes else torch.zeros(t.shape, dtype=WIRE_DTYPE) for t in tensors
        ]
        runner = _Runner(
            p2p=self.p2p,
            servicer_type=ReplicaAverager,
            prefix=self.namespace,
            group_id=group_id,
            tensors=local,
            weight=float(contributes),
            ordered_peer_ids=[PeerID.from_base58(p) for p in peers],
            peer_fractions=(1.0,) * len(peers),
            modes=(AveragingMode.NODE,) * len(peers),  # a non-contributor reduces a slice too
            sender_timeout=self.timeout_s,
            integers=any(integers),
        )
        slot = self._groups.setdefault(group_id, asyncio.get_running_loop().create_future())
        slot.set_result(runner)
        watch = asyncio.create_task(self._watch(runner))
        try:
            deltas = await asyncio.wait_for(self._deltas(runner), self.timeout_s)
        except TimeoutError:
            waiting = runner.waiting_for()
            raise AveragingError(
                f"averaging group {group_id!r}: no result within {self.timeout_s:g} s, waiting for {', '.join(map(str, waiting))}",
                waiting,
            ) from None
        except Exception as e:
            raise AveragingError(
                f"averaging group {group_id!r} failed: {self._blame(runner, e)}", runner.failed
            ) from None
        finally:
            watch.cancel()
            runner.close()
            self._groups.pop(group_id, None)
            _remember(self._finished, group_id)
        if runner.failed or runner.tensor_part_container.failed_size:  # a failure after the last part came
            raise AveragingError(f"averaging group {group_id!r} failed: {self._blame(runner, None)}", runner.failed)
        k = len(contributors)
        sums = [(x + d) * k for x, d in zip(local, deltas, strict=True)]
        if integers:
            sums = [recovered(total, k) if flag else total for total, flag in zip(sums, integers, strict=True)]
        return [total.to(device=t.device, dtype=t.dtype) for total, t in zip(sums, tensors, strict=True)]

    def refuse(self, group_id: bytes) -> None:
        """This peer will not join `group_id` (it cannot contribute what the group sums: the gather
        found its gradients stale). The members' streams for it get BAD_GROUP_ID and their probes
        hear it refused, so their sums fail now instead of waiting out `timeout_s` for it. A group
        whose sum already started here is left alone (it ends as it ends)."""
        slot = self._groups.get(group_id)
        if slot is not None and slot.done() and slot.result() is not None:
            return
        self._groups.pop(group_id, None)
        if slot is not None and not slot.done():
            slot.set_result(None)  # streams waiting for our runner of it: BAD_GROUP_ID
        _remember(self._finished, group_id)
        _remember(self._refused, group_id)

    async def _watch(self, runner: _Runner) -> None:
        """Fails `runner` as soon as a member it waits for cannot be dialed (its daemon is gone) or
        says it refused the group. A dial that is only slow proves nothing (a saturated link): the
        timeout decides then."""
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            for peer in runner.waiting_for():
                if peer == self.peer_id:
                    continue
                try:
                    refused = await asyncio.wait_for(self._dial(peer, runner.group_id), PROBE_TIMEOUT_S)
                except TimeoutError:
                    continue
                except Exception as e:
                    runner.fail(peer, f"unreachable ({one_line(e)})")
                    return
                if refused:
                    runner.fail(peer, "it refused the group")
                    return

    async def _dial(self, peer: PeerID, group_id: bytes) -> bool:
        """Sends `peer`'s averager a probe for `group_id`: whether it refused the group."""
        stub = ReplicaAverager.get_stub(self.p2p, peer, namespace=self.namespace)
        probe = averaging_pb2.AveragingData(group_id=group_id, code=PROBE_CODE)
        refused = False
        async for message in await stub.rpc_aggregate_part(as_aiter(probe)):
            refused = refused or message.code == averaging_pb2.GROUP_DISBANDED
        return refused

    @staticmethod
    async def _deltas(runner: _Runner) -> list[torch.Tensor]:
        return [delta async for delta in runner.run()]

    @staticmethod
    def _blame(runner: _Runner, error: BaseException | None) -> str:
        if runner.failed:
            return "; ".join(f"{peer}: {reason}" for peer, reason in runner.failed.items())
        return one_line(error) if error else "a reducer's slice did not come back"

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's parts for the slice we reduce: handed to our runner of its group, once our `sum`
        of that group has started (the member may be ahead of us; as DecentralizedAverager waits)."""
        try:
            first = await asyncio.wait_for(anext(stream), self.timeout_s)
        except (TimeoutError, StopAsyncIteration):
            return
        if first.code == PROBE_CODE:
            if first.group_id in self._refused:
                yield averaging_pb2.AveragingData(code=averaging_pb2.GROUP_DISBANDED)
            return
        runner = await self._runner(first.group_id)
        if runner is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        if context.remote_id not in runner:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield message

    async def _runner(self, group_id: bytes) -> _Runner | None:
        """Our runner of `group_id`, waiting up to `timeout_s` for it; None for a finished or unknown group."""
        if group_id in self._finished:
            return None
        slot = self._groups.setdefault(group_id, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(slot), self.timeout_s)
        except TimeoutError:
            if self._groups.get(group_id) is slot and not slot.done():
                del self._groups[group_id]
            return None


def _remember(ids: OrderedDict[bytes, None], group_id: bytes) -> None:
    """Adds `group_id`, forgetting the oldest past REMEMBERED_GROUPS."""
    ids[group_id] = None
    while len(ids) > REMEMBERED_GROUPS:
        ids.popitem(last=False)
