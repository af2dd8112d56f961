"""The owner's avoid tokens (trust.check_tokens), in process: only the peers of the stage before the
checked one can read which peers a check avoids; to every other stage, a check's micro-batch
carries what any micro-batch carries."""

from __future__ import annotations

from swarm.transport.hivemind.trust.check_tokens import AVOID_SLOTS, TOKEN_BYTES, CheckKeys, avoid_tokens, avoided

NEXT_STAGE = [f"Qm{'a' * 40}{i}" for i in range(4)]  # the checked stage's peers


def test_only_a_chooser_holding_its_key_finds_the_avoided_peers():
    keys = CheckKeys()
    choosers = [keys.of("session", "chooser-1"), keys.of("session", "chooser-2")]
    tokens = avoid_tokens(choosers, b"attempt", NEXT_STAGE[:1])
    for key in choosers:
        assert avoided(key, b"attempt", tokens, NEXT_STAGE) == {NEXT_STAGE[0]}
    for outsider in (keys.of("session", "stage-0 peer"), keys.of("other session", "chooser-1"), b""):
        assert avoided(outsider, b"attempt", tokens, NEXT_STAGE) == set()
    assert avoided(choosers[0], b"another attempt", tokens, NEXT_STAGE) == set()  # tokens are per attempt


def test_a_check_carries_as_many_tokens_of_the_same_size_as_any_micro_batch():
    keys = CheckKeys()
    check = avoid_tokens([keys.of("s", "q")], b"a", NEXT_STAGE[:2])
    plain = avoid_tokens([], b"b", [])
    assert len(check) == len(plain) == AVOID_SLOTS
    assert {len(t) for t in check + plain} == {TOKEN_BYTES}
    assert len(set(plain)) == AVOID_SLOTS  # random, not a constant a stage could recognise
    many = avoid_tokens([keys.of("s", str(i)) for i in range(5)], b"a", NEXT_STAGE[:3])
    assert len(many) == 2 * AVOID_SLOTS  # 15 real ones: rounded up to the slots


def test_a_members_key_is_stable_across_setups_of_a_session_and_secret_to_another_trainer():
    keys = CheckKeys()
    assert keys.of("s", "peer") == keys.of("s", "peer") != keys.of("s", "other")
    assert CheckKeys().of("s", "peer") != keys.of("s", "peer")
