"""The transport's one settings object and its one retry policy."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest
from _util import SMOKE

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.errors import RemoteError, TransportError
from swarm.transport.hivemind.retry import Retry
from swarm.transport.hivemind.settings import Settings


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "30"])
def test_a_setting_that_is_not_a_positive_number_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"^setting call_timeout_s must be a positive number"):
        Settings(call_timeout_s=bad)
    assert Settings(call_timeout_s=30).call_timeout_s == 30 and Settings().call_timeout_s == 120


@pytest.mark.parametrize("peer, flag", [("stage", "--timeout"), ("trainer", "--timeout"), ("trainer", "--wait")])
def test_a_bad_timeout_on_the_command_line_is_one_line(peer, flag, capsys):
    args = ["--stage", "0"] if peer == "stage" else []
    # the peer's main in this process: the error comes before any network (test_cli_run runs peers as processes)
    code = importlib.import_module(f"peers.{peer}").main(["--config", str(SMOKE), *args, flag, "0"])
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --timeout / --") and "must be a positive number, got 0" in line


def test_which_failures_are_tried_again_and_how_often():
    retry = Retry(Settings(attempts=3))
    reset = RemoteError("link reset", pb.LINK_RESET)
    assert retry.again(TransportError("gone"), 0) and retry.again(reset, 1)
    assert not retry.again(TransportError("gone"), 2)  # the third try was the last
    assert not retry.again(RemoteError("config mismatch"), 0)  # trying again would say the same
    assert not retry.again(ValueError("a bug of ours"), 0)
    assert not retry.again(TransportError("gone"), 0, deadline=time.monotonic() - 1)  # past its deadline


def test_a_round_is_retried_on_its_peer_after_a_growing_backoff_then_gives_up():
    retry = Retry(Settings(attempts=3, backoff_s=0.05))
    tries = []

    async def flaky():
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise TransportError("reply lost")
        return "applied"

    assert asyncio.run(retry.same_peer(flaky, "apply round")) == "applied"
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # backoff times the tries so far

    async def never():
        raise TransportError("peer gone")

    with pytest.raises(TransportError, match="peer gone"):
        asyncio.run(retry.same_peer(never, "apply round"))

    async def refused():
        tries.append(0)
        raise RemoteError("not set up")

    before = len(tries)
    with pytest.raises(RemoteError):
        asyncio.run(Retry(Settings()).same_peer(refused, "gather round"))
    assert len(tries) == before + 1  # an error reply is not a lost reply: no retry
