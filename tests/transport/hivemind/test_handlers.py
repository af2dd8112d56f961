"""The stage server's one table from call kind to handler, checked at import against the registry
(protocols.calls): a kind that loses its handler, or a handler of no call, fails before any peer
serves."""

from __future__ import annotations

import pytest

from protocols.calls import CALLS
from swarm.transport.hivemind.stage.rounds import KEPT, ON_THREAD, ROUNDS, StageRounds
from swarm.transport.hivemind.stage.server import HANDLERS, StageServer, checked


def test_every_registered_kind_has_a_handler_and_no_handler_lacks_a_kind():
    assert HANDLERS.keys() == CALLS.keys()
    assert all(callable(handler) for handler in HANDLERS.values())
    routed = {kind for kind, handler in HANDLERS.items() if handler is StageServer._serve_round}
    assert routed == ROUNDS


def test_a_kind_that_lost_its_handler_fails_the_check():
    for kind in CALLS:
        lost = {other: handler for other, handler in HANDLERS.items() if other != kind}
        with pytest.raises(ImportError, match=f"no handler of \\['{kind}'\\]"):
            checked(lost, ROUNDS if kind not in ROUNDS else ROUNDS - {kind})


def test_a_handler_of_no_call_and_a_round_nobody_serves_fail_the_check():
    with pytest.raises(ImportError, match="a handler of no call \\['rpc_gather'\\]"):
        checked({**HANDLERS, "rpc_gather": StageServer._serve_info}, ROUNDS)
    with pytest.raises(ImportError, match="rounds routed"):  # a kind routed to the rounds they do not serve
        checked({**HANDLERS, "info": StageServer._serve_round}, ROUNDS)
    with pytest.raises(ImportError, match="rounds routed"):  # a round the server never routes to them
        checked(HANDLERS, ROUNDS | {"setup"})


def test_the_rounds_table_names_each_round_by_its_kind():
    """`StageRounds` runs (and a joiner replays) rounds by this table, never by a method's name."""
    assert ON_THREAD.keys() <= CALLS.keys() and KEPT.keys() <= ON_THREAD.keys()
    for kind, round_ in ON_THREAD.items():
        assert round_ is getattr(StageRounds, round_.__name__) and round_.__name__ == kind  # traced by it
    kept = {kind: reply() for kind, reply in KEPT.items()}
    assert all(isinstance(reply, CALLS[kind].reply) for kind, reply in kept.items())
