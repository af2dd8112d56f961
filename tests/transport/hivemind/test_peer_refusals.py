"""What a stage peer or a trainer refuses before it joins a run (or before it touches the DHT),
each in one line: what it can check of its own options, config and data."""

from __future__ import annotations

import uuid

import torch
from _swarm_env import stage_errors
from _util import SMOKE

from swarm.config import load_config
from swarm.transport.hivemind.dht.runconfig import fetch_configs


def test_an_initial_peer_that_is_no_peer_address_is_refused_in_one_line(capsys):
    from peers.trainer import main

    cases = {
        "garbage": "error: --initial_peers 'garbage': not a multiaddr (Invalid MultiAddr 'garbage': Must begin with /)",
        "/ip4/127.0.0.1/tcp/31337": "error: --initial_peers '/ip4/127.0.0.1/tcp/31337': it names no peer: "
        "it must end in /p2p/PEER_ID (the bootstrap prints its full address)",
    }
    for maddr, message in cases.items():
        capsys.readouterr()
        assert main(["--config", str(SMOKE), "--initial_peers", maddr]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [message]


def test_a_stage_peer_checks_its_own_config_before_it_joins(swarm, capsys, tmp_path):
    # nobody listens there: had the peer started its daemon first, it would fail to reach the bootstrap
    nowhere = "/ip4/127.0.0.1/tcp/1/p2p/QmXerPtSxm7o8xV9yaYG99bhcm41CJ5z8Dafd6vq8fzggv"
    gone = tmp_path / "gone.yaml"
    assert stage_errors(capsys, swarm.loop, "--initial_peers", nowhere, "--config", str(gone)) == [
        f"error: config file {gone} does not exist"
    ]
    stages = load_config(SMOKE).model.num_stages
    assert stage_errors(capsys, swarm.loop, "--initial_peers", nowhere, "--config", str(SMOKE), "--stage", "9") == [
        f"error: --stage 9 does not exist: the config has {stages} stages (0..{stages - 1})"
    ]
    too_many = ("--config", str(SMOKE), "--set", "model.num_stages=9")
    assert stage_errors(capsys, swarm.loop, "--initial_peers", nowhere, *too_many) == [
        "error: digits_cnn: 4 blocks can be split into 1..4 stages, not 9"
    ]
    missing = f"cuda:{torch.cuda.device_count()}"
    (line,) = stage_errors(capsys, swarm.loop, "--initial_peers", nowhere, "--config", str(SMOKE), "--device", missing)
    assert line.startswith(f"error: device {missing}: this machine has "), line
    # without --config the run's config comes from the DHT, but --device is the peer's own
    (line,) = stage_errors(capsys, swarm.loop, "--initial_peers", nowhere, "--device", missing)
    assert line.startswith(f"error: device {missing}: this machine has "), line


def test_a_trainer_whose_data_cannot_be_read_publishes_no_config(swarm, capsys):
    """Its data is built before it publishes: a stage peer joining by the DHT finds no config of a
    run whose trainer already failed (the record would have lived on for its TTL)."""
    from peers.trainer import main

    run_id = f"bad-data-{uuid.uuid4().hex[:6]}"
    maddr = str(swarm.maddrs[0])
    capsys.readouterr()
    assert (
        main(
            [
                "--config",
                str(SMOKE),
                "--set",
                "data.options.test_subset=5000",
                "--run_id",
                run_id,
                "--initial_peers",
                maddr,
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: digits test: subset=5000 is larger than the 1397 samples available"
    )
    assert swarm.loop.run(fetch_configs(swarm.trainer, run_id)) == []
