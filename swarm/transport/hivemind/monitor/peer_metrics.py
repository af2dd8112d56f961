"""What every peer's metrics have: its DHT view and its events by kind (a bootstrap peer has only
these and its process's)."""

from __future__ import annotations

from swarm.transport.hivemind.monitor.exporter import Collector, Families
from swarm.transport.hivemind.net.node import SwarmNode


def fill_node(families: Families, node: SwarmNode) -> None:
    table = node.dht.protocol.routing_table
    families.gauge("dht_peers", "DHT peers in this node's routing table", len(table.uid_to_peer_id))


def fill_events(families: Families, counts: dict[str, int], role: str) -> None:
    """Every kind, those that never happened at 0 (so increase() sees the first)."""
    for kind, n in sorted(counts.items()):
        families.counter("events", "joins, leaves, bans, pauses... since it started", n, kind=kind, role=role)


class NodeCollector(Collector):
    def __init__(self, node: SwarmNode) -> None:
        self.node = node

    def fill(self, families: Families) -> None:
        fill_node(families, self.node)
