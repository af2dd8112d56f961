"""Wrong compute caught: `train.verify` runs a fraction of a step's training micro-batches a second
time, on another peer of one replicated stage, and compares the results.

With equal thread counts a micro-batch gives the same floats on any peer holding the same weights
(replicas do, bit for bit: swarm.transport.hivemind.stage.averaging), so the check can be tight:
the stage's gradient digest (a hash of the bits of the gradients it holds for that micro-batch,
which every stage reports with every training micro-batch while verification is on, so no member
can tell which of its micro-batches are checked; a wrong forward changes it too, through the
gradient that comes back for the wrong output) must be equal. A model whose kernels are not
deterministic (some GPU ops) sets `train.verify_tolerance`: the digest is then the gradients'
squared norm, and both must agree within it, relative. The owner picks the micro-batches (as the step is handed over)
and the stage (after they ran) with a system random source, and nothing of the picks leaves it
until a check runs: a member cannot know in advance which of its results are compared. With an
asynchronous schedule the next step's micro-batches enter after the step's checks (trainer.dispatch),
so a peer a check leaves out ran nothing of the next step. Steps without a check keep the pipeline
full. Members set up at the start of the session are incumbents; a peer that joined later is on
probation until one of its results matched another peer's, and checks go to stages with peers on
probation first. With `train.verify_probation` N a peer on probation has every micro-batch it served
checked, against a trusted peer of its stage (two new identities never vouch for each other), until
N of its results matched: only then does its work count unchecked. Identities cost a key; this makes
each cost N micro-batches of honest work, and no wrong result of a new one reaches a step.

When two peers disagree, the one on probation (else the later admitted) is left out of the run and
never set up again in this session, and this step's micro-batches that went through it run again
(its earlier steps' work stays: a fraction below 1 leaves some of it unchecked).
The codecs must keep no state across micro-batches (a second route has other link states) and be
fixed (no adaptive compression).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable

import torch

from protocols.carried import payload_sha256
from protocols.wire_names import DIGEST
from swarm.compression.spec import keeps_state
from swarm.config import ExperimentConfig
from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.net.meta import carried_of
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace
from swarm.transport.hivemind.trainer.verdict import Expected, Finding, chain_fault, first_divergence

log = logging.getLogger(__name__)

Item = tuple[MicroBatch, torch.Tensor]


def check_verifiable(cfg: ExperimentConfig) -> None:
    """One line when `cfg` asks for verification its codecs cannot give."""
    if not cfg.train.verify:
        return
    if cfg.compression.adaptive is not None:
        raise ValueError("train.verify needs fixed codecs: turn compression.adaptive off")
    for boundary in range(cfg.model.num_stages - 1):
        link = cfg.compression.link(boundary)
        for spec in (link.forward, link.backward):
            if keeps_state(spec):
                raise ValueError(
                    f"train.verify compares two routes of a micro-batch, which {spec!r} (state kept across micro-batches) makes differ: use codecs without error feedback"
                )


class Verification:
    """`run_one(item, avoid)`: the micro-batch once more, through none of `avoid` = (stage, peers):
    its metrics and route; `run_again(items)`: this step's micro-batches once more (their metrics)."""

    def __init__(
        self,
        place: TrainerPlace,
        membership: Membership,
        position: Position,
        cfg: ExperimentConfig,
        run_one: Callable[[Item, tuple[int, list[str]]], Awaitable[tuple[dict, list[str]]]],
        run_again: Callable[[list[Item]], Awaitable[list[dict]]],
    ) -> None:
        check_verifiable(cfg)
        self.place, self.membership, self.position = place, membership, position
        self.fraction, self.tolerance = cfg.train.verify, cfg.train.verify_tolerance
        self.run_one, self.run_again = run_one, run_again
        self.random = random.SystemRandom()  # the members cannot foresee the owner's picks
        self.incumbents: set[str] | None = None  # the members of the session's start
        self.trusted: set[str] = set(cfg.train.verifiers)  # verifiers, incumbents, peers whose results matched
        self.probation = cfg.train.verify_probation  # every micro-batch of a new peer checked until this many matched
        self.matched: Counter[str] = Counter()  # a peer on probation -> its results that matched a trusted peer's
        self.checks = self.mismatches = 0

    def draw(self, items: list[Item]) -> frozenset[int]:
        """The indices of the step's micro-batches to check: each with probability `fraction`."""
        return frozenset(batch.index for batch, _ in items if self.random.random() < self.fraction)

    def on_probation(self) -> bool:
        """Whether a member in service has all its micro-batches checked (`verify_probation`): its
        step's checks are made whatever was drawn (an asynchronous next step waits for them)."""
        return bool(self.probation and self.incumbents is not None and self._probationers())

    def _probationers(self) -> set[str]:
        return {peer for stage in self.membership.members for peer in self.membership.serving(stage)} - self.trusted

    async def check(self, items: list[Item], results: list[dict], picks: frozenset[int]) -> dict[int, dict]:
        """Checks the step's finished micro-batches of `picks` (`draw`; `results`: their metrics, with
        the stages' digests); the metrics of micro-batches run again (their peer was left out), by index."""
        if self.incumbents is None:
            self.incumbents = {peer for _, peer in self.membership.peers()}
            self.trusted |= self.incumbents
        redone: dict[int, dict] = {}
        pending = list(zip(items, results, strict=True))
        while pending:
            again: dict[int, dict] = {}
            for (batch, inputs), metrics in pending:
                route = self.position.routes.get(batch.index)
                if route is None:
                    continue
                for pick in self._probation_picks(route) or ([self._pick(route)] if batch.index in picks else []):
                    if pick is not None and batch.index not in again:
                        await self._check_one(pick, (batch, inputs), route, metrics, again)
            redone.update(again)
            # those run again went through other peers: a new one's results there are checked too
            pending = [(item, again[item[0].index]) for item in items if item[0].index in again]
            pending, picks = (pending if self.probation else []), frozenset()
        return redone

    async def _check_one(self, pick, item: Item, route: list[str], metrics: dict, redone: dict[int, dict]) -> None:
        """Runs `item` again at `pick` = (stage, the peer to run it) and compares; on a mismatch the
        suspect is left out and its micro-batches' metrics, run again, go into `redone`."""
        (batch, inputs), (stage, target) = item, pick
        avoid = [peer for peer in self.membership.members.get(stage, []) if peer != target]
        again, second_route = await self.run_one((batch, inputs), (stage, avoid))
        first, second = route[stage], second_route[stage]
        accounted = getattr(metrics, "accounts", None) is not None and getattr(again, "accounts", None) is not None
        if accounted:  # the stages' signed accounts say which peer differed, wherever it is
            verdict = await self._verdict((batch, inputs), (metrics, again))
            if verdict is None and second == first:
                return  # the stage before did not avoid it: inconclusive
            self.checks += 1
            if verdict is None:
                self._matched(first, second)
                return
            stage, suspect, why = verdict
        else:  # a tolerance (kernels that are not deterministic): the checked stage's digests only
            if second == first:
                return
            self.checks += 1
            if self._agree(metrics, again, stage):
                self._matched(first, second)
                return
            suspect = self._suspect(stage, first, second)
            theirs, ours = (metrics, again) if suspect == second else (again, metrics)
            why = self._differed(stage, second if suspect == first else first, ours, theirs)
        self.mismatches += 1
        self._leave_out(stage, suspect, f"its result of micro-batch {batch.key}: {why}")
        # its micro-batches, and the checked one (peers on both runs hold the second run's gradients)
        redo = [
            (b, x)
            for b, x in self.position.sent.values()
            if suspect in self.position.routes[b.index] or b.index == batch.index
        ]
        for (b, _), result in zip(redo, await self.run_again(redo), strict=True):
            redone[b.index] = result

    def _matched(self, first: str, second: str) -> None:
        """Two peers' results agreed: a peer on probation matched once more (trusted after
        `verify_probation` matches with a trusted peer; without it, after one match with anyone)."""
        if not self.probation:
            self.trusted.update((first, second))
            return
        for peer, other in ((first, second), (second, first)):
            if peer not in self.trusted and other in self.trusted:
                self.matched[peer] += 1
                if self.matched[peer] >= self.probation:
                    self.trusted.add(peer)

    def _probation_picks(self, route: list[str]) -> list[tuple[int, str]]:
        """With `verify_probation`: a check at every stage of `route` served by a peer on probation,
        run again on a trusted peer of that stage (none there: it cannot be checked)."""
        if not self.probation:
            return []
        picks = []
        for stage, peer in enumerate(route):
            trusted = [p for p in self.membership.serving(stage) if p != peer and p in self.trusted]
            if peer not in self.trusted and trusted:
                picks.append((stage, self.random.choice(trusted)))
        return picks

    def _pick(self, route: list[str]) -> tuple[int, str] | None:
        """The stage to check and the peer to run the micro-batch again on: a stage with a peer on
        probation first (its result, or its run of another's), else any with another peer in service."""
        others = {s: [p for p in self.membership.serving(s) if p != peer] for s, peer in enumerate(route)}
        probation: list[tuple[int, str]] = []  # (stage, a peer on probation there)
        for s, peer in enumerate(route):
            if not others[s]:
                continue
            if peer not in self.trusted:  # its result is checked: run again on another
                probation.append((s, peer))
            else:  # it runs the micro-batch again
                probation.extend((s, p) for p in others[s] if p not in self.trusted)
        if probation:
            stage, suspect = self.random.choice(probation)
            if suspect != route[stage]:
                return stage, suspect
            return stage, self.random.choice(others[stage])
        stages = [s for s in others if others[s]]
        if not stages:
            return None
        stage = self.random.choice(stages)
        return stage, self.random.choice(others[stage])

    def _agree(self, a: dict, b: dict, stage: int) -> bool:
        """Whether both runs' digests of `stage` agree. Only that stage's: the loss comes from the last
        stage, whichever peer served it (another machine's rounding is not the checked peer's fault)."""
        x, y = a.get(f"{DIGEST}{stage}"), b.get(f"{DIGEST}{stage}")
        if x is None or y is None:
            return False
        return abs(x - y) <= self.tolerance * max(abs(x), abs(y), 1e-30)

    def _suspect(self, stage: int, first: str, second: str) -> str:
        """Of two peers that disagree: the one that is not the owner's verifier, else the one on
        probation, else the later admitted."""
        verifiers = self.membership.verifiers
        if (first in verifiers) != (second in verifiers):
            return second if first in verifiers else first
        trusted = [peer for peer in (first, second) if peer in self.trusted]
        if len(trusted) == 1:
            return second if trusted[0] == first else first
        members = self.membership.members.get(stage, [])
        order = {peer: members.index(peer) if peer in members else len(members) for peer in (first, second)}
        return max((first, second), key=order.get)

    async def _verdict(self, item: Item, runs: tuple) -> tuple[int, str, str] | None:
        """Whom two runs' accounts convict, as (stage, peer, why), or None when they agree; a tie
        between two peers of a stage goes to a third run there (else `_suspect`)."""
        (batch, inputs), place = item, self.place
        input_sha = payload_sha256(carried_of(batch, inputs))
        expected = Expected(place.run_id, batch.step, batch.index, place.num_stages, input_sha)
        for run in runs:
            if (fault := chain_fault(run.accounts, run.attempt, expected)) is not None:
                return fault.stage, fault.peers[0], fault.why
        finding = first_divergence(runs[0].accounts, runs[1].accounts)
        if finding is None:
            return None
        if len(finding.peers) == 1:
            return finding.stage, finding.peers[0], finding.why
        return finding.stage, await self._settle(item, finding, runs, expected), finding.why

    async def _settle(self, item: Item, finding: Finding, runs: tuple, expected: Expected) -> str:
        """Of two peers of a stage whose runs differ there: the one whose run a trusted third peer's
        run of the micro-batch does not reproduce (new identities never outvote an incumbent);
        without one, `_suspect`'s choice."""
        stage, (first, second) = finding.stage, finding.peers
        serving = self.membership.serving(stage)
        alike = all((first in group) == (second in group) for group in (self.trusted, self.membership.verifiers))
        if alike and (judges := [p for p in serving if p in self.trusted and p not in finding.peers]):
            avoid = [peer for peer in serving if peer not in judges]
            third, route = await self.run_one(item, (stage, avoid))
            if route[stage] in judges and chain_fault(third.accounts, third.attempt, expected) is None:
                differ = [first_divergence(run.accounts, third.accounts) is not None for run in runs]
                if differ == [True, False]:
                    return first
                if differ == [False, True]:
                    return second
        return self._suspect(stage, first, second)

    @staticmethod
    def _differed(stage: int, other: str, ours: dict, theirs: dict) -> str:
        """How a peer's result (`ours`) differed from `other`'s (`theirs`), by digests."""
        shown = ", ".join(
            f"{name} {ours.get(key, float('nan')):.9g} vs {theirs.get(key, float('nan')):.9g}"
            for name, key in (("gradient digest", f"{DIGEST}{stage}"), ("loss", "loss"))
        )
        return f"differed from peer {other[-8:]}'s ({shown})"

    def _leave_out(self, stage: int, suspect: str, why: str) -> None:
        """`suspect` is out of the session for good."""
        why = f"{why}; verified, not trusted"
        self.place.router.failed(suspect)
        self.membership.convict(stage, suspect, why)
        log.warning("stage %d: peer %s left out: %s", stage, suspect[-8:], why)
