"""A private run (`peers.trainer --allow ...` / `--private`) takes only the stage peers it allows by
name or by a token of its owner (`python -m peers.token`); others are never set up nor routed to."""

from __future__ import annotations

import base64
import subprocess
import sys
import uuid

import pytest
from _swarm_env import smoke
from _util import REPO
from hivemind.utils.crypto import RSAPrivateKey

from peers.token import main as token_main
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.trainer.pipeline import RunAccess, SwarmPipeline
from swarm.transport.hivemind.trust import tokens
from swarm.transport.hivemind.trust.keys import load_identity, own_peer_id

STEPS = 3


def test_only_allowed_peers_and_token_holders_join(swarm):
    cfg = smoke()
    run_id = uuid.uuid4().hex[:8]
    n = cfg.model.num_stages
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(n)] + [(1, n)])  # a second stage-1 peer, not allowed
    outsider = hosted[-1]
    key = RSAPrivateKey()
    allowed = [h.node.peer_id for h in hosted[:-1]]
    try:
        data = build_data(cfg)
        pipeline = SwarmPipeline(swarm.trainer, swarm.loop, cfg, run_id, access=RunAccess(key, allowed))
        members = pipeline.setup(Schedule.of(cfg, len(data[0]), STEPS).lr_horizon, len(data[0]), wait_s=20)
        assert outsider.node.peer_id not in members[1] and outsider.runtime is None
        # a token of another owner, or one that expired, lets nobody in
        for token in (
            tokens.issue_token(RSAPrivateKey(), run_id, outsider.node.peer_id),
            tokens.issue_token(key, run_id, hosted[0].node.peer_id),
        ):
            outsider.place.token = base64.urlsafe_b64decode(token)
            swarm.loop.run(swarm.hosts[n][1].announcer.announce_now())
            assert outsider.node.peer_id not in [r.peer_id for r in swarm.loop.run(pipeline.router.peers(1, True))]
        # the owner's token for it: it joins at a step boundary
        outsider.place.token = base64.urlsafe_b64decode(tokens.issue_token(key, run_id, outsider.node.peer_id, 3600))
        swarm.loop.run(swarm.hosts[n][1].announcer.announce_now())
        assert outsider.node.peer_id in [r.peer_id for r in swarm.loop.run(pipeline.router.peers(1, True))]
        train(cfg, pipeline, data, ResultsWriter(None), STEPS, progress=False)
        assert outsider.node.peer_id in pipeline.members[1] and outsider.runtime is not None
    finally:
        swarm.unhost(run_id)


def test_tokens_expire_and_name_one_peer_of_one_run():
    key = RSAPrivateKey()
    owner = own_peer_id(key)
    token = base64.urlsafe_b64decode(tokens.issue_token(key, "run", "QmPeer", 60))
    assert tokens.allows(token, owner, "run", "QmPeer")
    assert not tokens.allows(token, owner, "run", "QmPeer", now=tokens.time.time() + 61)
    assert not tokens.allows(token, owner, "other", "QmPeer")
    assert not tokens.allows(token, owner, "run", "QmOther")
    assert not tokens.allows(token, own_peer_id(RSAPrivateKey()), "run", "QmPeer")
    assert not tokens.allows(token[:-3] + b"abc", owner, "run", "QmPeer")
    assert tokens.parse_duration("7d") == 7 * 86400 and tokens.parse_duration("90") == 90
    with pytest.raises(ValueError, match="not a duration"):
        tokens.parse_duration("soon")


def _token_cli(*args: str, home) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peers.token", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"HIVEPIPE_HOME": str(home), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )


@pytest.mark.peers
def test_the_token_command_prints_a_peer_id_and_a_token_the_owner_signed(tmp_path, monkeypatch, capsys):
    joiner = tmp_path / "joiner.key"
    out = _token_cli("--peer_of", str(joiner), home=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == own_peer_id(load_identity(joiner))
    monkeypatch.setenv("HIVEPIPE_HOME", str(tmp_path))  # the rest in this process: a process costs seconds
    assert token_main(["--run_id", "r", "--peer", out.stdout.strip()]) == 2
    assert "no identity file" in capsys.readouterr().err  # the owner has no key here yet
    owner_key = load_identity(tmp_path / "owner.key")
    assert token_main(["--run_id", "r", "--peer", out.stdout.strip(), "--expires", "1h"]) == 0
    token = tokens.read_token(capsys.readouterr().out.strip())
    assert tokens.token_owner(token) == own_peer_id(owner_key) and token.peer_id == out.stdout.strip()
    for bad, says in ((["--expires", "soon"], "--expires"), (["--peer", "x"], "--peer must be a peer id")):
        args = ["--run_id", "r", "--peer", out.stdout.strip(), *bad]
        code, err = token_main(args), capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1
