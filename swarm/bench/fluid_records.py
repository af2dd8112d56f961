"""What a sender in the fluid swarm model (swarm.bench.fluid_swarm) reads of the replicas' records:
their queue and throughput as the DHT has them, not as they are.

A replica announces its record every `announce_s` (a stage's replicas at evenly spread phases); a
sender looks a stage's records up every `lookup_s`, first at its first choice (at the step's start
the records are the previous step's end: queues empty, throughputs not yet measured this step).
What it reads is thus up to `announce_s + lookup_s` old. Either at 0: that part is always current.
"""

from __future__ import annotations

from collections.abc import Callable


class StaleRecords:
    def __init__(self, announce_s: float, lookup_s: float, now: Callable[[str], tuple[int, float]]) -> None:
        """`now(replica)`: its (queue, throughput) at this instant."""
        self.announce_s, self.lookup_s, self.now = announce_s, lookup_s, now
        self.announced: dict[str, tuple[int, float]] = {}
        self.next_announce: dict[str, float] = {}
        self.looked_up: dict[tuple[str, str], tuple[float, dict[str, tuple[int, float]]]] = {}

    def read(self, sender: str, names: list[str], t: float) -> dict[str, tuple[int, float]]:
        """{replica: (queue, throughput)} of one stage's replicas `names` as `sender` reads them at `t`."""
        for i, name in enumerate(names):
            if self.announce_s <= 0:
                self.announced[name] = self.now(name)
                continue
            due = self.next_announce.setdefault(name, self.announce_s * (i + 0.5) / len(names))
            while due <= t:  # announced at `due`, read at the first choice since: the state has moved little
                self.announced[name], due = self.now(name), due + self.announce_s
            self.next_announce[name] = due
        key = (sender, names[0])
        if self.lookup_s <= 0 or key not in self.looked_up or t >= self.looked_up[key][0] + self.lookup_s:
            self.looked_up[key] = (t, {name: self.announced.get(name, (0, 0.0)) for name in names})
        return self.looked_up[key][1]
