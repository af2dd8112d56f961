"""The lab's link probe before a run: the trainer's link to every other process, both ways
(between them, those paths cross every access link), printed as the lab's own lines."""

from __future__ import annotations

import asyncio

from swarm.lab.probe import probe_in_process
from swarm.lab.probe_namespaces import probe_netlab
from swarm.netlab.shaper import TokenBucket
from swarm.rates import parse_rate


def _probe_bytes(lab) -> int:
    """About half a second's worth on the slowest link."""
    slowest = min((parse_rate(r) for r in (lab.link_plan.rates or {}).values()), default=10**9)
    return int(min(max(slowest / 8 * 0.5, 256 * 1024), 8 * 2**20))


def _print_probe(lab, tag: str, results: dict, nbytes: int) -> None:
    for name, measured in results.items():
        text = ", ".join(f"{r.direction} {r.mbit_per_s:.1f} Mbit/s" for r in measured)
        lab.output.say(tag, f"probe trainer<->{name}: {text or 'no result'} (payload over libp2p, {nbytes} bytes)")


def probe_namespaces(lab) -> None:
    """Measures the trainer's link to every other process (both directions) before the run:
    between them, those paths cross every access link."""
    nbytes, others = _probe_bytes(lab), lab.run_plan.names[:-1]
    try:
        results = probe_netlab(lab.net, "trainer", others, nbytes, spawner=lab.spawner)
    except Exception as e:  # a diagnostic: the run goes on without it
        lab.output.say("netlab", f"probe failed: {type(e).__name__}: {e}")
        return
    _print_probe(lab, "netlab", {name: results.get(name, []) for name in others}, nbytes)


def probe_inprocess(lab) -> None:
    """The same probe through the shapers the peers will use: two loopback peers in this process,
    each pacing its sends as the trainer and one stage will (up: the trainer's, down: the stage's)."""

    def bucket(name: str) -> TokenBucket:
        # the rate of the peer's --shape_rate only: the probe measures throughput, not delay
        return TokenBucket(lab.link_plan.rate(name) or "100gbit")

    nbytes, results = _probe_bytes(lab), {}
    try:
        for name in lab.run_plan.names[1:-1]:
            results[name] = asyncio.run(probe_in_process(nbytes, bucket=bucket("trainer"), server_bucket=bucket(name)))
    except Exception as e:  # a diagnostic: the run goes on without it
        lab.output.say("lab", f"probe failed: {type(e).__name__}: {e}")
        return
    _print_probe(lab, "lab", results, nbytes)
