"""The transport's one settings object and its one retry policy."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest
import torch
from _util import SMOKE

from protocols import stage_pb2 as pb
from protocols import wire
from protocols.errors import PayloadError, RemoteError, TransportError
from protocols.message import Encoded, RawPart, SparsePart
from swarm.transport.hivemind.net.retry import Retry
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.trainer.dispatch import micro_batches_in_flight


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "30"])
def test_a_setting_that_is_not_a_positive_number_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"^setting call_timeout_s must be a positive number"):
        Settings.of(call_timeout_s=bad)
    assert Settings.of(call_timeout_s=30).calls.call_timeout_s == 30 and Settings().calls.call_timeout_s == 120
    with pytest.raises(ValueError, match=r"^unknown setting\(s\): call_timeout$"):
        Settings.of(call_timeout=30)


def test_decoding_limits_follow_the_micro_batch_payload_limit():
    limits = Settings.of(max_micro_batch_bytes=4096).limits.decode_limits
    assert limits.max_payload_bytes == 4096 and limits.max_elements == 2048
    assert Settings().limits.decode_limits.max_elements == 1 << 29  # 1 GiB: an exact fp16 tensor that fills it
    fits = wire.encode(Encoded((2000,), torch.float16, RawPart(torch.ones(2000, dtype=torch.float16))))
    assert len(fits) < 4096 and wire.decode(fits, limits).shape == (2000,)
    # a sparse payload of a few bytes that would decode to one element more
    values = RawPart(torch.ones(1))
    sparse = wire.encode(Encoded((2049,), torch.float32, SparsePart(1, torch.tensor([0]), values)))
    with pytest.raises(PayloadError, match="tensor of 2049 elements exceeds the limit of 2048"):
        wire.decode(sparse, limits)


def test_micro_batches_in_flight_stay_within_what_a_stage_peer_takes_from_one_sender():
    settings = Settings()
    assert micro_batches_in_flight(None, 4, settings) == 8 and micro_batches_in_flight(12, 4, settings) == 12
    assert micro_batches_in_flight(None, 40, settings) == 64  # two per stage, up to the peer's limit
    with pytest.raises(ValueError, match=r"^train.in_flight=65: a stage peer takes at most 64 micro-batches"):
        micro_batches_in_flight(65, 4, settings)


@pytest.mark.parametrize("peer, flag", [("stage", "--timeout"), ("trainer", "--timeout"), ("trainer", "--wait")])
def test_a_bad_timeout_on_the_command_line_is_one_line(peer, flag, capsys):
    args = ["--stage", "0"] if peer == "stage" else []
    # the peer's main in this process: the error comes before any network (test_cli_run runs peers as processes)
    code = importlib.import_module(f"peers.{peer}").main(["--config", str(SMOKE), *args, flag, "0"])
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --timeout / --") and "must be a positive number, got 0" in line


def test_which_failures_are_tried_again_and_how_often():
    retry = Retry(Settings.of(attempts=3))
    reset = RemoteError("link reset", pb.LINK_RESET)
    assert retry.again(TransportError("gone"), 0) and retry.again(reset, 1)
    assert not retry.again(TransportError("gone"), 2)  # the third try was the last
    assert not retry.again(RemoteError("config mismatch"), 0)  # trying again would say the same
    assert not retry.again(ValueError("a bug of ours"), 0)
    assert not retry.again(TransportError("gone"), 0, deadline=time.monotonic() - 1)  # past its deadline


def test_a_round_is_retried_on_its_peer_after_a_growing_backoff_then_gives_up():
    retry = Retry(Settings.of(attempts=3, backoff_s=0.05))
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
