"""Wiring a config into stages: what the digest that trainer and stages compare covers."""

from __future__ import annotations

from _swarm_env import smoke

from swarm.engine.build import config_digest


def test_config_digest_covers_what_stages_compute():
    base = smoke()
    assert config_digest(base) == config_digest(
        smoke("train.batch_size=20", "name=other", "compression.store_dir=/tmp/elsewhere")
    )
    assert config_digest(base) != config_digest(smoke("compression.forward=quant:4", "compression.backward=none"))
    assert config_digest(base) != config_digest(smoke("seed=1"))
    assert config_digest(base) != config_digest(smoke("train.precision=bf16"))
    assert config_digest(base) != config_digest(smoke("train.checkpoint_activations=true"))
