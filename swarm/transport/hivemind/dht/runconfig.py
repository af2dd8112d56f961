"""A run's config published in the DHT, so a stage peer can join with `--stage` and `--initial_peers`.

The trainer, and every stage peer started with `--config`, stores the config's YAML text and its
`--set` overrides under one key per run with one subkey per config digest: two configs published
for one run stay visible side by side, and a joiner refuses to guess between them. The trainer's
subkey also names the run's owner (`[owner:KEY]`): hivemind's RSASignatureValidator, on every
node, lets only that key write it, so a joiner learns whom to obey from it and nobody can forge
it; a run claimed by two owners is refused until `--owner` picks one. The run is also
listed under `RUNS_KEY` as a stage announcement lists it, so `peers.status` and a joiner without
`--run_id` find a run whose trainer published before any stage peer announced. Records expire
unless re-published, so a finished run's config drops out on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from swarm.config import ConfigError, ExperimentConfig, config_from_text
from swarm.engine.build import config_digest
from swarm.transport.hivemind.dht.announce import list_run, list_runs
from swarm.transport.hivemind.dht.periodic import Refresher
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.schemas import owned

log = logging.getLogger(__name__)

POLL_S = 0.5  # between looks at the DHT while waiting for a run's config to appear


def config_key(run_id: str) -> str:
    return f"hivepipe.{run_id}.config"


class RunConfigError(RuntimeError):
    """No run config to join, or more than one to choose from; the message is one line."""


@dataclass
class PublishedConfig:
    """What a run publishes about its config (plain data: DHT values are msgpack)."""

    run_id: str
    yaml: str
    overrides: list[str]
    digest: str
    num_stages: int
    owner: str = ""  # the peer id of the key that signed the record (the run's owner); "" unsigned

    @classmethod
    def of(cls, run_id: str, text: str, overrides: Sequence[str], where: str) -> PublishedConfig:
        """The record of YAML `text` with `overrides` (ConfigError if they are not a valid config)."""
        cfg = config_from_text(text, list(overrides), where)
        return cls(run_id, text, list(overrides), config_digest(cfg), cfg.model.num_stages)

    @classmethod
    def from_value(cls, run_id: str, value) -> PublishedConfig | None:
        """None for anything that is not a well-formed record: DHT values come from any peer."""
        if not isinstance(value, dict):
            return None
        text, overrides = value.get("yaml"), value.get("overrides")
        digest, num_stages = value.get("digest"), value.get("num_stages")
        if not isinstance(text, str) or not isinstance(digest, str) or not digest:
            return None
        if not isinstance(overrides, list | tuple) or not all(isinstance(o, str) for o in overrides):
            return None
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            return None
        return cls(run_id, text, list(overrides), digest, num_stages)

    def to_value(self) -> dict:
        return {
            "yaml": self.yaml,
            "overrides": list(self.overrides),
            "digest": self.digest,
            "num_stages": self.num_stages,
        }

    def config(self, local: Sequence[str] = ()) -> ExperimentConfig:
        """The config as published, then this peer's `local` overrides (e.g. its device); it must
        still have the published digest, or this peer would compute something else than the run."""
        where = f"run {self.run_id!r}'s published config"
        try:
            cfg = config_from_text(self.yaml, [*self.overrides, *local], where)
        except ConfigError as e:
            message = str(e)
            raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
        if (digest := config_digest(cfg)) != self.digest:
            raise ConfigError(
                f"{where} gives digest {digest} here, {self.digest} published (another hivepipe version?)"
            )
        return cfg


async def publish(node: SwarmNode, run_id: str, published: PublishedConfig, ttl: float, owned: bool = False) -> bool:
    """Stores the record; `owned`: signed by this node's key as the run's owner's."""
    expires = get_dht_time() + ttl
    # listed as announce() lists a run, so a run is found before any of its stages announces
    await list_run(node, run_id, published.num_stages, expires)
    subkey = published.digest.encode() + node.owned_by if owned else published.digest
    return await node.dht.store(config_key(run_id), published.to_value(), expires, subkey=subkey)


def _digest_and_owner(subkey) -> tuple[str, str]:
    """A config record's subkey: its digest, and its owner's peer id ("" unsigned)."""
    signed = owned(subkey)
    return (signed[0].decode(errors="replace"), signed[1]) if signed else (str(subkey), "")


async def fetch_configs(node: SwarmNode, run_id: str, owner: str | None = None) -> list[PublishedConfig]:
    """The well-formed configs published for `run_id`: the ones an owner signed (only `owner`'s, when
    given) or, when none is, the unsigned ones."""
    found = await node.dht.get(config_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    configs: list[PublishedConfig] = []
    for subkey, item in found.value.items():
        digest, signer = _digest_and_owner(subkey)
        record = PublishedConfig.from_value(run_id, getattr(item, "value", None))
        if record is not None and record.digest == digest and owner in (None, signer or owner):
            record.owner = signer
            configs.append(record)
    # an owner's record outranks unsigned ones (a stage peer's with --config, or anyone's)
    signed = [c for c in configs if c.owner]
    return sorted(signed or configs, key=lambda c: (c.digest, c.owner))


async def published_runs(node: SwarmNode) -> dict[str, list[PublishedConfig]]:
    """run id -> its published configs, for every listed run that has published one."""
    run_ids = list(await list_runs(node))
    found = await asyncio.gather(*(fetch_configs(node, run_id) for run_id in run_ids))
    return {run_id: configs for run_id, configs in zip(run_ids, found, strict=True) if configs}


def _one_of(run_id: str, configs: list[PublishedConfig]) -> PublishedConfig:
    owners = sorted({c.owner for c in configs if c.owner})
    if len(owners) > 1:
        raise RunConfigError(
            f"run {run_id!r} is claimed by {len(owners)} owners ({', '.join(owners)}): pass --owner with the one its trainer printed"
        )
    if len(configs) > 1:
        digests = ", ".join(c.digest for c in configs)
        raise RunConfigError(
            f"run {run_id!r} has {len(configs)} different published configs ({digests}): pass --config to pick one"
        )
    return configs[0]


async def resolve_run(node: SwarmNode, run_id: str | None, wait_s: float, owner: str | None = None) -> PublishedConfig:
    """The one config to join: of `run_id`, or of the only run on the DHT that published one.
    Waits up to `wait_s` seconds for one to appear (a trainer may be starting); RunConfigError
    when there is none by then, or when there is more than one to choose from."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        if run_id is None:
            runs = await published_runs(node)
            if len(runs) > 1:
                listed = ", ".join(f"{r} ({configs[0].num_stages} stages)" for r, configs in runs.items())
                raise RunConfigError(f"{len(runs)} runs on this DHT: {listed}; pick one with --run_id")
            if runs:
                return _one_of(*next(iter(runs.items())))
        elif configs := await fetch_configs(node, run_id, owner):
            return _one_of(run_id, configs)
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        await asyncio.sleep(min(POLL_S, left))
    if run_id is None:
        raise RunConfigError(
            f"no run on this DHT published its config within {wait_s:g}s: start the run's trainer "
            "(or a stage peer with --config) first, or pass --config"
        )
    raise RunConfigError(
        f"run {run_id!r} published no config within {wait_s:g}s: check --run_id, start its trainer "
        "(or a stage peer with --config) first, or pass --config"
    )


class ConfigPublisher(Refresher):
    """Re-publishes a run's config every `announce_every_s` seconds (the node's settings) until stopped."""

    def __init__(self, node: SwarmNode, run_id: str, published: PublishedConfig, owned: bool = False) -> None:
        super().__init__(node)
        self.run_id, self.published, self.owned = run_id, published, owned

    async def publish_now(self) -> None:
        try:
            if not await publish(self.node, self.run_id, self.published, self.ttl, self.owned):
                # also when another publisher's copy of the same record expires later: not worth a warning
                log.debug("publishing the config of %s: no DHT peer stored it", self.run_id)
        except Exception as e:  # the DHT may be briefly unreachable; the next round retries
            log.warning("publishing the config of %s failed: %s", self.run_id, e)

    refresh = publish_now


async def start_publishing(node: SwarmNode, published: PublishedConfig, owned: bool = False) -> ConfigPublisher:
    """Publishes `published` for its run from now on (`owned`: as its owner, signed with the
    node's key), unless the run already has other configs published and not this one
    (RunConfigError): that peer and this one would not compute alike."""
    others = [c.digest for c in await fetch_configs(node, published.run_id)]
    if others and published.digest not in others:
        raise RunConfigError(
            f"--config differs from run {published.run_id}'s published config: "
            f"digest {published.digest} here, {', '.join(others)} published"
        )
    publisher = ConfigPublisher(node, published.run_id, published, owned)
    await publisher.publish_now()
    publisher.start()
    return publisher
