"""Whom two runs of one micro-batch convict, from the stages' signed accounts (trust.evidence).

A run's accounts convict on their own a peer that passed on what it must have refused: an account
missing or not signed by its stage's peer, or one whose hashes contradict its neighbour's (each
stage checks its downstream's account before it adds its own, so the contradiction is the fault of
the peer that passed it on), or stage 0's account of an input other than the owner's. Between two
runs whose accounts hold, the stages' computations are deterministic at equal weights (the sums are
exact): the first stage whose equal inputs gave other outputs, forward from stage 0, then backward
from the last, holds the wrong peer. One peer there (it served both runs): it alone. Two: one of
them, which a third run decides (`swarm.transport.hivemind.trainer.verify`)."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.transport.hivemind.trust.evidence import author_of


@dataclass(frozen=True)
class RunAccounts:
    """One run of a micro-batch as the owner saw it: the stage-0 peer it sent it to, and the
    signed accounts that came back (stage order)."""

    first_peer: str
    evidence: tuple


class Accounted(dict):
    """A training micro-batch's metrics, with what its run's accounts say (`accounts`, of attempt
    `attempt`) while verification is on."""

    accounts: RunAccounts | None = None
    attempt: bytes = b""


@dataclass(frozen=True)
class Expected:
    """What every account of a run must name: the run, its micro-batch and stages, and the SHA-256 of
    the payload the owner sent stage 0."""

    run_id: str
    step: int
    index: int
    num_stages: int
    input_sha: bytes


@dataclass(frozen=True)
class Finding:
    """The stage whose peer is wrong: `peers` has one peer (convicted), or two (one of them is)."""

    stage: int
    peers: tuple[str, ...]
    why: str


def chain_fault(run: RunAccounts, attempt: bytes, expected: Expected) -> Finding | None:
    """The peer `run`'s accounts convict on their own (of attempt `attempt`), or None."""
    collator, previous = run.first_peer, None
    for stage in range(expected.num_stages):
        account = run.evidence[stage] if stage < len(run.evidence) else None
        named = account is not None and (
            account.run_id,
            account.step,
            account.index,
            account.attempt,
            account.stage,
        ) == (expected.run_id, expected.step, expected.index, attempt, stage)
        author = author_of(account) if named else None
        if author is None or (stage == 0 and author != run.first_peer):
            return Finding(max(stage - 1, 0), (collator,), f"it passed on no valid account of stage {stage}")
        if stage == 0 and account.forward_in != expected.input_sha:
            return Finding(0, (author,), "its account names an input other than the one the owner sent")
        if previous is not None and (
            account.forward_in != previous.forward_out or previous.backward_in != account.backward_out
        ):
            return Finding(stage - 1, (collator,), f"it passed on an account of stage {stage} contradicting its own")
        previous, collator = account, author
    if previous.forward_out or previous.backward_in:
        return Finding(expected.num_stages - 1, (collator,), "its account as the last stage names a next stage")
    return None


def first_divergence(a: RunAccounts, b: RunAccounts) -> Finding | None:
    """The first stage where two runs with valid accounts (`chain_fault`) got equal inputs and gave
    other outputs, or None: the runs agree on every stage."""
    stages = range(min(len(a.evidence), len(b.evidence)))
    for stage in stages:
        x, y = a.evidence[stage], b.evidence[stage]
        if x.forward_in == y.forward_in and x.forward_out != y.forward_out:
            return _found(stage, x, y, "forward")
    for stage in reversed(stages):
        x, y = a.evidence[stage], b.evidence[stage]
        if (x.forward_in, x.backward_in) != (y.forward_in, y.backward_in):
            continue  # (cannot happen after the forward pass agreed: their inputs came from agreeing stages)
        if (x.backward_out, x.digest, x.loss) != (y.backward_out, y.digest, y.loss):
            return _found(stage, x, y, "backward")
    return None


def _found(stage: int, x, y, direction: str) -> Finding:
    peers = tuple(dict.fromkeys((author_of(x), author_of(y))))
    if len(peers) == 1:
        why = f"its {direction} pass gave two different results for the same inputs"
    else:
        why = f"its {direction} pass gave a result other than the other peer's for the same inputs"
    return Finding(stage, peers, why)
