"""The owner's manifests of the swarm's copies, in process: which weights a stage's copies must
hold (the digest most of its peers report) and what that digest covers."""

from __future__ import annotations

import torch

from swarm.transport.hivemind.trust import manifests


def _saved(weight: float, running_mean: float, names=("w",)) -> dict:
    return {
        "module": {"w": torch.full((3,), weight), "bn.running_mean": torch.full((3,), running_mean)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "scheduler": {"last_epoch": 4},
        "delay": None,
        "rng": torch.arange(4, dtype=torch.uint8),  # each peer's own
        manifests.PARAMETERS: list(names),
    }


def test_the_weights_digest_covers_parameters_and_optimizer_state_not_buffers_or_rng():
    base = manifests.weights_digest(_saved(1.0, 0.0))
    assert manifests.weights_digest(_saved(1.0, 5.0)) == base  # running statistics are each peer's own
    other_rng = _saved(1.0, 0.0)
    other_rng["rng"] = torch.zeros(4, dtype=torch.uint8)
    assert manifests.weights_digest(other_rng) == base
    assert manifests.weights_digest(_saved(1.0 + 1e-7, 0.0)) != base  # one parameter's last bits
    stepped = _saved(1.0, 0.0)
    stepped["optimizer"]["state"][0]["momentum_buffer"][1] = 2.0
    assert manifests.weights_digest(stepped) != base
    stepped = _saved(1.0, 0.0)
    stepped["scheduler"]["last_epoch"] = 5
    assert manifests.weights_digest(stepped) != base
    # a copy that names fewer parameters (to change one unseen) has another digest: the names count
    assert manifests.weights_digest(_saved(9.0, 0.0, names=())) != base


def test_a_stage_s_manifest_names_the_copies_of_the_weights_most_of_its_peers_report():
    named, outvoted = manifests.agreed([("a", b"A", b"good"), ("b", b"B", b"bad"), ("c", b"C", b"good")])
    assert (named.copies, named.weights, outvoted) == ({b"A", b"C"}, b"good", ["b"])
    named, outvoted = manifests.agreed([("a", b"A", b"first"), ("b", b"B", b"second")])  # a tie: the earliest admitted
    assert (named.copies, named.weights, outvoted) == ({b"A"}, b"first", ["b"])
    named, outvoted = manifests.agreed([("a", b"A", b"w"), ("b", b"B", b"w")])
    assert (named.copies, outvoted) == ({b"A", b"B"}, [])
