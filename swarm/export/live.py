"""A run's state from a live swarm: the newest copies its stage peers keep of every stage
(swarm.transport.hivemind.stage.snapshots), fetched for an export as a restoring peer fetches
them: `python -m swarm export --initial_peers ... --run_id RUN --out DIR`.

Only the run's owner can. A stage peer hands a copy only to a peer that shows an admission signed
with the owner's key (swarm.transport.hivemind.trust.gate), so the exporter, a peer of its own on
the DHT, signs one for its own peer id with the key the trainer signs with (`--identity_path`),
for a session of its own: an admission good for nothing but copies. And it takes only copies the
owner's manifests name, as a restore does: the newest step of which the peers hold a copy of every
stage, each copy's SHA-256 one the manifest lists and its weights the digest the stage's peers
agreed on. A run that finished dropped its copies: export its checkpoint then.
"""

from __future__ import annotations

import asyncio
import io
import uuid

from hivemind.utils.crypto import RSAPrivateKey

from protocols.errors import RemoteError, TransportError, one_line
from protocols.stubs import STUBS
from swarm.config import ExperimentConfig
from swarm.engine.checkpoint import read_stage
from swarm.export.state import RunState
from swarm.transport.hivemind.dht.announce import discover
from swarm.transport.hivemind.dht.runconfig import resolve_run
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.trainer.copies import held_named, named_of, newest_complete, shown_manifests
from swarm.transport.hivemind.trainer.membership import stage_statuses
from swarm.transport.hivemind.trust import manifests
from swarm.transport.hivemind.trust.admissions import issue
from swarm.transport.hivemind.trust.keys import own_peer_id


class LiveRun:
    """The exporter's side of one run: its node, the owner's key, and the admission it shows."""

    def __init__(self, node: SwarmNode, run_id: str | None, owner_key: RSAPrivateKey, timeout: float) -> None:
        self.node, self.run_id, self.owner_key, self.timeout = node, run_id, owner_key, timeout
        self.owner = own_peer_id(owner_key)
        self.session = f"export-{uuid.uuid4().hex}"  # its own: the admission serves copies only

    async def config(self) -> ExperimentConfig:
        """The config the owner published for the run (the only run on the DHT when no run id is given)."""
        published = await resolve_run(self.node, self.run_id, self.timeout, owner=self.owner)
        self.run_id = published.run_id
        return published.config()

    async def state(self, cfg: ExperimentConfig | None = None) -> RunState:
        """The newest complete set of copies the owner's manifests name, read (`cfg`: the run's,
        else the one its owner published)."""
        cfg = cfg if cfg is not None else await self.config()
        if self.run_id is None:
            raise ValueError("--run_id: which run to export (its trainer's --run_id, by default its config's name)")
        run_id, stages = self.run_id, cfg.model.num_stages
        found = await asyncio.gather(*(discover(self.node, run_id, stage) for stage in range(stages)))
        peers = [(stage, record.peer_id) for stage, records in enumerate(found) for record in records]
        if not peers:
            raise ValueError(f"run {run_id!r}: no stage peer announces itself on this DHT")
        statuses = await stage_statuses(self.node, run_id, peers, self.timeout)
        accepted = shown_manifests(statuses, self.owner, run_id)
        choice = newest_complete(held_named(statuses, accepted), stages)
        if choice is None:
            raise ValueError(
                f"run {run_id!r}: its {len(peers)} stage peer(s) hold no complete set of copies signed by owner"
                f" {self.owner[-8:]} (a finished run drops them; is --identity_path the trainer's key?)"
            )
        lineage, step, sources = choice
        states = []
        for stage in range(stages):
            states.append(await self._download(stage, step, sources[stage], named_of(accepted, lineage, step, stage)))
        return RunState(cfg, step, states, f"run {run_id}'s copies of step {step}")

    async def _download(self, stage: int, step: int, sources: list, named: manifests.Named) -> dict:
        """The copy of `stage` at `step` from the first of `sources` ((peer, the stage it hosts))
        that hands one the manifest names."""
        errors = []
        for peer, hosted in sources:
            admission = issue(self.owner_key, self.run_id, self.session, self.node.peer_id, hosted)
            request = STUBS.state(
                to=address(self.run_id, hosted), snapshot=True, stage=stage, step=step, admission=admission
            )
            try:
                frame = await ask(self.node.streams, peer, request, self.timeout)
                saved = _checked(frame.payload, named)
            except (TransportError, RemoteError, ValueError) as e:
                errors.append(f"{peer[-8:]}: {one_line(e, 120)}")
                continue
            return saved
        raise ValueError(f"no copy of stage {stage} at step {step} from {len(sources)} peer(s) ({'; '.join(errors)})")


def _checked(payload: bytes, named: manifests.Named) -> dict:
    """The stage file in `payload` if it is a copy the owner's manifest names (ValueError if not)."""
    if manifests.digest(payload) not in named.copies:
        raise ValueError("its copy is not one the owner's manifest names")
    saved = read_stage(io.BytesIO(payload))
    if named.weights and manifests.weights_digest(saved) != named.weights:
        raise ValueError("its copy holds weights other than those its stage's peers agreed on")
    return saved


async def live_state(node: SwarmNode, run_id: str | None, owner_key: RSAPrivateKey, cfg, timeout: float) -> RunState:
    """`LiveRun(...).state(cfg)`: the run's state from the copies its stage peers keep."""
    return await LiveRun(node, run_id, owner_key, timeout).state(cfg)
