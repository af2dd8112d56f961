"""Whom the trainer leaves out when only averaging groups failed (trainer.blame), in process: the
replies are those the stage peers give (tests/transport/hivemind/test_joining.py and
test_hostile_members.py run them on real groups)."""

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.transport.hivemind.trainer.blame import blamed_members

HOST, STOPPED, JOINER, OTHER = "peer-host", "peer-stopped", "peer-joiner", "peer-other"


def _failed(*named: str) -> RemoteError:
    return RemoteError("averaging group failed", pb.GROUP_FAILED, list(named))


def _blame(replies: dict[str, object], members: list[str], serving: list[str] | None = None) -> list[str]:
    peers = [(1, peer) for peer in replies]
    left = blamed_members(peers, list(replies.values()), {1: members}, lambda stage: serving or members)
    return [peer for _, peer, _ in left]


def test_a_stopped_replica_leaves_and_the_joiner_that_failed_in_turn_stays():
    """The cascade from the CI run: a replica stops mid-round (it fails its group itself), the
    joiner gives up on the group because of it, and the host, whose later part the joiner answers
    with BAD_GROUP_ID, names the joiner. The joiner was admitted last, but its own failure names
    the stopped replica: the replica leaves, the joiner stays."""
    replies = {HOST: _failed(JOINER), STOPPED: _failed(STOPPED), JOINER: _failed(STOPPED)}
    assert _blame(replies, [HOST, STOPPED, JOINER]) == [STOPPED]


def test_a_member_that_answers_success_but_never_sums_leaves_first():
    replies = {HOST: _failed(OTHER), OTHER: "info reply", JOINER: _failed(OTHER)}
    left = blamed_members(
        [(1, p) for p in replies], list(replies.values()), {1: [HOST, OTHER, JOINER]}, lambda s: [HOST, OTHER, JOINER]
    )
    assert [peer for _, peer, _ in left] == [OTHER]
    assert "named by" in left[0][2] and "answered the gather round with success" in left[0][2]


def test_two_members_that_name_each_other_leave_the_latest_admitted_and_the_other_stays():
    replies = {HOST: _failed(JOINER), JOINER: _failed(HOST)}
    assert _blame(replies, [HOST, JOINER]) == [JOINER]


def test_the_member_more_members_name_leaves():
    replies = {HOST: _failed(OTHER), JOINER: _failed(OTHER), OTHER: _failed(HOST)}
    assert _blame(replies, [HOST, OTHER, JOINER]) == [OTHER]


def test_a_stage_keeps_its_last_peer_in_service_whatever_it_is_named_for():
    """The host answers success and the joiner (still catching up, not in service) names it: on
    any other stage the host would leave first; here it is the stage's only peer in service."""
    replies = {HOST: "info reply", JOINER: _failed(HOST)}
    assert _blame(replies, [HOST, JOINER], serving=[HOST]) == []
    assert _blame(replies, [HOST, JOINER]) == [HOST]


def test_a_member_that_names_only_itself_and_nobody_names_stays_for_the_probe():
    """Nobody else names it: no group failed on it in anyone else's word (the trainer probes then)."""
    replies = {HOST: "info reply", STOPPED: _failed(STOPPED)}
    assert _blame(replies, [HOST, STOPPED]) == []


def test_more_accusers_outweigh_a_failure_that_names_nobody():
    """An honest member's failure may name nobody (a reducer's slice did not come back): the member
    two others name still leaves first, and the one it named stays."""
    replies = {HOST: _failed(OTHER), JOINER: _failed(OTHER), STOPPED: _failed(), OTHER: _failed(STOPPED)}
    assert _blame(replies, [HOST, STOPPED, OTHER, JOINER]) == [OTHER]
