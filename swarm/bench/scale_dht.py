"""What a swarm of S stages x R replicas asks of the DHT, counted from what the code publishes and
looks up (swarm.transport.hivemind.dht):

- every stage peer re-announces every `announce_every_s` (its `Announcer`): two stores, its entry in
  the run listing (`RUNS_KEY`, one key for every run and peer) and its stage record (one key per
  stage, one subkey per peer); a peer started with `--config` also republishes the config (two more);
- the trainer republishes the config (`ConfigPublisher`: two stores) as often and its run status
  (`StatusPublisher`) every EVERY_S;
- every router looks its next stage up again after `lookup_every_s` while it routes: each peer of
  stages 0..S-2 its next stage, the trainer stage 0 and, at each step boundary, every stage for
  joiners (`Membership.candidates`, through the same cache).

Every store of one key lands on the same few DHT nodes (its nearest), so the hottest key, the run
listing with one subkey per peer, sets the load one node must take: `hottest_stores_per_s`. A
stage key's readers each fetch all its R records: `stage_read_bytes_per_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.transport.hivemind.dht.runstatus import EVERY_S as STATUS_EVERY_S
from swarm.transport.hivemind.net.settings import Settings

# A stage record as stored: its msgpack value (~700 bytes with two addresses and the owner's
# admission: run, session, peer id, the owner's RSA key and signature), the subkey naming the peer's
# RSA key and the value's signature (hivemind's RSASignatureValidator)
RECORD_BYTES = 1500


@dataclass(frozen=True)
class DhtLoad:
    stores_per_s: float
    lookups_per_s: float
    hottest_stores_per_s: float  # on the nodes holding the run listing
    stage_read_bytes_per_s: float  # out of the nodes holding the busiest stage key

    @property
    def records_per_s(self) -> float:
        return self.stores_per_s + self.lookups_per_s


def dht_load(stages: int, replicas: int, step_s: float, peers_publish_config: bool = False) -> DhtLoad:
    """The DHT's load in steady state (module doc); `step_s`: the trainer's step boundaries."""
    dht = Settings().dht
    peers = stages * replicas
    per_peer = 2 + (2 if peers_publish_config else 0)
    trainer = 2 / dht.announce_every_s + 1 / min(dht.announce_every_s, STATUS_EVERY_S)
    stores = peers * per_peer / dht.announce_every_s + trainer
    routing = (stages - 1) * replicas / dht.lookup_every_s  # every peer but the last stage's
    boundaries = stages / max(dht.lookup_every_s, step_s)  # the trainer's view of every stage
    lookups = routing + max(boundaries, 1 / dht.lookup_every_s)
    listing = (peers + 1) / dht.announce_every_s  # every peer's entry and the trainer's config's
    reads = replicas / dht.lookup_every_s * replicas * RECORD_BYTES  # R readers fetch R records
    return DhtLoad(stores, lookups, listing, reads)
