"""A stage peer's links: one link end per neighbour peer, and what each link carried.

Error-feedback state and reused TopK indices live in link ends (`swarm.engine.linkend`), so a
stage peer keeps one end per neighbour: the pair's state stays on the pair, and a new neighbour
starts fresh. Ends are replaced, never reset in place (a compute may still hold the old one):
- an upstream neighbour's end is replaced when its messages start a new link epoch
  (`swarm.transport.hivemind.flow.ordering`: the sender restarted its end after a failure);
- a downstream neighbour's end is dropped when the link to it fails (`drop_out`); the next message
  to it makes a new end and starts a new epoch, so the receiver restarts its end too.
The first end made on each side is the runtime's own (`spare`), which a checkpoint may have restored.
Byte counts of replaced ends are kept (`retired`): the status reports a link's totals across its epochs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

from swarm.config import ExperimentConfig
from swarm.engine.build import link_end
from swarm.engine.linkend import LinkEnd, LinkEnds
from swarm.transport.hivemind.flow.meter import LinkMeter
from swarm.transport.hivemind.flow.ordering import Numbering, Turnstile


class NeighbourLinks:
    """`config()`: the stage's config in force (its codecs are the ones new ends get)."""

    def __init__(self, stage: int, num_stages: int, config: Callable[[], ExperimentConfig]) -> None:
        self.stage, self.num_stages = stage, num_stages
        self.config = config
        # every link restarts (a checkpoint or copy installed, our outbound codecs switched): the
        # handoff then chooses the next stage's peer afresh
        self.on_restart: Callable[[], None] = lambda: None
        self.capacity: int | None = None
        self.ends_in: dict[str, LinkEnd] = {}  # upstream peer -> our half of that link
        self.ends_out: dict[str, LinkEnd] = {}  # downstream peer -> our half of that link
        self.numbering = Numbering()  # of our messages to each downstream peer
        self.turnstiles: dict[str, Turnstile] = {}  # of each upstream peer's messages to us
        self.received: Counter = Counter()  # (neighbour, direction, mode) -> bytes
        # how fast each upstream peer's activations arrive
        self.arrivals: defaultdict[str, LinkMeter] = defaultdict(LinkMeter)
        # how fast each downstream peer's gradients arrive
        self.replies: defaultdict[str, LinkMeter] = defaultdict(LinkMeter)
        # (neighbour, upstream) -> boundary, bytes sent and their uncompressed size, of replaced ends
        self.retired: dict[tuple[str, bool], tuple[int, Counter, Counter]] = {}
        self.upstream: str | None = None  # the neighbour whose link a checkpoint keeps
        self._spare: dict[bool, LinkEnd | None] = {}
        self._made = 0

    def start(self, capacity: int | None, own: LinkEnds) -> None:
        """A new session: no link, no counts; the first ends made are `own`."""
        self.capacity = capacity
        for table in (self.turnstiles, self.received, self.arrivals, self.replies, self.retired):
            table.clear()
        self.restore(own)

    def restore(self, own: LinkEnds) -> None:
        """A loaded checkpoint: every link restarts from `own` (its ends) with a new epoch; the
        counts of what the links carried so far stay."""
        self._spare = {False: own.inbound, True: own.outbound}
        for upstream, table in ((False, self.ends_in), (True, self.ends_out)):
            for neighbour, end in table.items():
                self._retire(neighbour, upstream, end)
        self.ends_in.clear()
        self.ends_out.clear()
        self.numbering.clear()
        self.upstream = None
        self.on_restart()

    def fresh(self, label: str, cfg: ExperimentConfig) -> LinkEnds:
        """New ends of this stage's own (one per side it has) with `cfg`'s codecs (`label`: what for)."""
        return LinkEnds(
            None if self.stage == 0 else self.make(False, label, cfg),
            None if self.stage == self.num_stages - 1 else self.make(True, label, cfg),
        )

    def make(self, upstream: bool, label: str, cfg: ExperimentConfig | None = None) -> LinkEnd:
        """A new end of ours with the codecs of `cfg` (default: the config in force), its AQ-SGD
        rows in a directory of its own."""
        cfg = cfg or self.config()
        store = cfg.compression.store_dir
        self._made += 1
        store = None if store is None else f"{store}/stage{self.stage}-{label}-{self._made}"
        boundary = self.stage if upstream else self.stage - 1
        return link_end(cfg, boundary, upstream, self.capacity, store)

    def _new(self, upstream: bool, neighbour: str) -> LinkEnd:
        spare = self._spare.get(upstream)
        if spare is not None:
            self._spare[upstream] = None
            return spare
        return self.make(upstream, neighbour[-12:])

    def end_in(self, sender: str, fresh: bool) -> LinkEnd:
        """Our end of the link from `sender`; `fresh`: its messages started a new epoch."""
        end = self.ends_in.get(sender)
        if end is None or fresh:
            self._retire(sender, False, self.ends_in.get(sender))
            end = self.ends_in[sender] = self._new(False, sender)
        self.upstream = sender
        return end

    def end_out(self, receiver: str) -> LinkEnd:
        """Our end of the link to `receiver`; a new end starts a new epoch."""
        end = self.ends_out.get(receiver)
        if end is None:
            end = self.ends_out[receiver] = self._new(True, receiver)
            self.numbering.restart(receiver)
        return end

    def drop_out(self, receiver: str) -> None:
        """Our link with `receiver` lost its order or state: the next message starts a new epoch."""
        self._retire(receiver, True, self.ends_out.pop(receiver, None))

    def _retire(self, neighbour: str, upstream: bool, end: LinkEnd | None) -> None:
        if end is None:
            return
        _, sent, raw = self.retired.setdefault((neighbour, upstream), (end.boundary, Counter(), Counter()))
        sent.update(end.bytes)
        raw.update(end.raw)

    def switch(self, changed: list[int]) -> None:
        """New codecs on the `changed` boundaries: their ends go, the next messages start new epochs."""
        for boundary in changed:
            upstream = boundary == self.stage  # we send activations on it
            self._spare[upstream] = None  # the runtime's own end has the old codecs
            if upstream:
                for receiver in list(self.ends_out):
                    self.drop_out(receiver)
                self.on_restart()
            else:
                for sender in list(self.ends_in):
                    self._retire(sender, False, self.ends_in.pop(sender))

    def in_use(self, downstream: str | None) -> LinkEnds:
        """The ends a checkpoint keeps: those of the links in use (the last upstream sender, the
        downstream peer micro-batches follow), else the runtime's own, else any."""
        ends = []
        for upstream, table, neighbour in ((False, self.ends_in, self.upstream), (True, self.ends_out, downstream)):
            ends.append(table.get(neighbour) or self._spare.get(upstream) or next(reversed(table.values()), None))
        return LinkEnds(*ends)

    def state_bytes(self) -> int:
        return sum(end.state_bytes for end in (*self.ends_in.values(), *self.ends_out.values()))
