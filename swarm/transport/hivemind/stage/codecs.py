"""Adaptive compression on a stage peer: new codecs on its boundaries, between two steps.

The trainer sends them with a step's apply round (ApplyRequest.codecs) to every peer of every stage,
when no micro-batch is in flight; each peer takes the boundaries it sits on (the one before it
and the one after it). Its config's per-boundary overrides change, and its ends of a changed
boundary go (stage.links.NeighbourLinks.switch): that link's next message starts a new epoch
(swarm.transport.hivemind.flow.ordering) and both ends
build fresh state for the new codecs (the old codecs' error feedback and TopK indices mean nothing
to the new ones). The config digest the trainer checks at setup stays the one of the config the
peer started with, and a new trainer session starts from that config's codecs again.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocols import stage_pb2 as pb
from protocols.errors import ProtocolError
from swarm.compression.spec import parse
from swarm.config import ExperimentConfig, LinkConfig, LinkOverride


def switched_config(
    cfg: ExperimentConfig, stage: int, codecs: Iterable[pb.BoundaryCodecs]
) -> tuple[ExperimentConfig, list[int]]:
    """`cfg` with `codecs` on `stage`'s boundaries, and the boundaries whose codecs change.

    Checked before the step applies, so a bad spec fails the round without a half-done switch."""
    comp = cfg.compression
    overrides = dict(comp.boundaries)
    changed = []
    for change in codecs:
        boundary = int(change.boundary)
        if boundary not in (stage - 1, stage) or boundary >= cfg.model.num_stages - 1:
            continue
        try:
            parse(change.forward), parse(change.backward)
            link = LinkConfig(forward=change.forward, backward=change.backward)
            link.check(f"codecs for boundary {boundary}")
        except ValueError as e:
            raise ProtocolError(f"codecs for boundary {boundary}: {str(e).splitlines()[0]}") from None
        if comp.link(boundary) == link:
            continue
        overrides[boundary] = LinkOverride(forward=link.forward, backward=link.backward)
        changed.append(boundary)
    if not changed:
        return cfg, []
    return cfg.model_copy(update={"compression": comp.model_copy(update={"boundaries": overrides})}), changed
