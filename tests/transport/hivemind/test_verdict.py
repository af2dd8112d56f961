"""The owner's reading of two runs' signed accounts (trainer.verdict), in process: who a run's
accounts convict on their own, and the first stage whose equal inputs gave other outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.trainer.verdict import Expected, RunAccounts, chain_fault, first_divergence
from swarm.transport.hivemind.trust.evidence import Author, Hashes, account, author_of, check_downstream, sha256
from swarm.transport.hivemind.trust.keys import peer_id_of

STAGES = 3
INPUT = sha256(b"the owner's input")


@pytest.fixture(scope="module")
def keys() -> list[RSAPrivateKey]:
    return [RSAPrivateKey() for _ in range(5)]


def _peer(key: RSAPrivateKey) -> str:
    return peer_id_of(key.get_public_key().to_bytes())


def _batch(attempt: bytes) -> MicroBatch:
    return MicroBatch(step=3, index=1, sample_ids=torch.arange(2), targets=torch.zeros(2), attempt=attempt)


def _run(keys, attempt: bytes, wrong: dict[int, str] | None = None) -> RunAccounts:
    """Honest accounts of a run through `keys` (one per stage), except where `wrong` = {stage:
    "forward" or "backward"}: that stage's peer sends other activations or gradients."""
    wrong = wrong or {}
    forward = [INPUT]
    for stage in range(STAGES - 1):  # what each stage sends on: a function of what it got
        tag = b"!" if wrong.get(stage) == "forward" else b""
        forward.append(sha256(forward[-1] + tag))
    backward = [b""] * (STAGES + 1)  # backward[s]: what stage s sends back (the last one's from its loss)
    for stage in reversed(range(1, STAGES)):
        tag = b"!" if wrong.get(stage) == "backward" else b""
        backward[stage] = sha256(forward[stage] + backward[stage + 1] + tag)
    accounts = []
    for stage, key in enumerate(keys):
        hashes = Hashes(
            forward[stage],
            forward[stage + 1] if stage < STAGES - 1 else b"",
            backward[stage + 1] if stage < STAGES - 1 else b"",
            backward[stage] if stage else b"",
        )
        digest = float(int.from_bytes(sha256(forward[stage] + backward[stage + 1])[:6], "big"))
        author = Author(key, "run", "session", stage)
        accounts.append(account(author, _batch(attempt), hashes, digest, 1.5 if stage == STAGES - 1 else 0.0))
    return RunAccounts(_peer(keys[0]), tuple(accounts))


EXPECTED = Expected("run", 3, 1, STAGES, INPUT)


def test_honest_runs_through_other_peers_agree_and_convict_nobody(keys):
    a, b = _run(keys[:3], b"a"), _run([keys[0], keys[3], keys[2]], b"b")
    assert chain_fault(a, b"a", EXPECTED) is None and chain_fault(b, b"b", EXPECTED) is None
    assert first_divergence(a, b) is None


def test_a_framer_elsewhere_on_both_routes_is_found_alone_not_the_checked_stage(keys):
    """Stage 1 is checked (peers 1 and 3); stage 2's peer, on both routes, sends other gradients in
    the second run: the first stage whose equal inputs gave other outputs is stage 2, and one peer
    served both runs there: it alone."""
    a = _run(keys[:3], b"a")
    b = _run([keys[0], keys[3], keys[2]], b"b", {2: "backward"})
    finding = first_divergence(a, b)
    assert finding.stage == 2 and finding.peers == (_peer(keys[2]),), finding
    assert "two different results for the same inputs" in finding.why


def test_two_peers_of_a_stage_that_differ_on_equal_inputs_are_named_together(keys):
    """A stage-1 peer of the second run sends other activations: stage 1, between its two peers (a
    third run decides which; trainer.verify)."""
    a = _run(keys[:3], b"a")
    b = _run([keys[0], keys[3], keys[2]], b"b", {1: "forward"})
    finding = first_divergence(a, b)
    assert finding.stage == 1 and set(finding.peers) == {_peer(keys[1]), _peer(keys[3])}


def test_an_account_changed_on_the_way_back_convicts_the_peer_that_passed_it_on(keys):
    run = _run(keys[:3], b"a")
    forged = run.evidence[2].__class__()
    forged.CopyFrom(run.evidence[2])
    forged.loss = 0.25  # stage 1's peer changes the last stage's loss: the signature no longer holds
    bad = RunAccounts(run.first_peer, (run.evidence[0], run.evidence[1], forged))
    finding = chain_fault(bad, b"a", EXPECTED)
    assert finding.peers == (_peer(keys[1]),) and "no valid account of stage 2" in finding.why


def test_an_account_dropped_or_contradicting_its_neighbour_convicts_the_peer_that_passed_it_on(keys):
    run = _run(keys[:3], b"a")
    dropped = RunAccounts(run.first_peer, run.evidence[:2])
    assert chain_fault(dropped, b"a", EXPECTED).peers == (_peer(keys[1]),)
    other = _run([keys[0], keys[1], keys[4]], b"a", {2: "backward"})  # stage 2 signed other gradients
    spliced = RunAccounts(run.first_peer, (run.evidence[0], run.evidence[1], other.evidence[2]))
    finding = chain_fault(spliced, b"a", EXPECTED)
    assert finding.stage == 1 and finding.peers == (_peer(keys[1]),) and "contradicting" in finding.why


def test_stage_0_naming_another_input_or_another_attempt_is_convicted(keys):
    run = _run(keys[:3], b"a")
    assert chain_fault(run, b"a", dataclasses.replace(EXPECTED, input_sha=sha256(b"x"))).peers == (_peer(keys[0]),)
    assert chain_fault(run, b"another attempt", EXPECTED).peers == (_peer(keys[0]),)


def test_a_stage_checks_its_downstreams_account_before_passing_it_on(keys):
    run = _run(keys[:3], b"a")
    account_1 = run.evidence[1]
    where = ("run", 1, _peer(keys[1]))
    batch = _batch(b"a")
    assert check_downstream(list(run.evidence[1:]), batch, where, account_1.forward_in, account_1.backward_out) is None
    assert "other than those exchanged" in check_downstream(
        list(run.evidence[1:]), batch, where, sha256(b"other"), account_1.backward_out
    )
    assert "not signed by it" in check_downstream(
        list(run.evidence[1:]), batch, ("run", 1, _peer(keys[4])), account_1.forward_in, account_1.backward_out
    )
    assert "without its account" in check_downstream([], batch, where, b"", b"")
    assert author_of(account_1) == _peer(keys[1])
