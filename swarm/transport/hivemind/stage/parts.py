"""What a hosted stage's collaborators share (the chain, the rounds, closing on the way, joining,
the swarm's copies, leaving): its state and the pieces that act on it, made once by the host
(stage.host) and handed to each as one object rather than as the same long list of arguments."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.transport.hivemind.routing.handoff import Handoff
from swarm.transport.hivemind.stage.links import NeighbourLinks
from swarm.transport.hivemind.stage.state import PeerServices, StageMeters, StagePlace, StageState
from swarm.transport.hivemind.stage.work import StageWork
from swarm.transport.hivemind.trust.gate import Gate


@dataclass(frozen=True)
class StageParts:
    state: StageState  # the stage as the run has it now (its `place`: where it is)
    meters: StageMeters  # what its status and DHT record report of its work
    work: StageWork  # its computing thread
    links: NeighbourLinks  # one link end per neighbour peer
    handoff: Handoff | None  # to the next stage's peers (None on the last stage)
    gate: Gate  # who may call it
    peer: PeerServices  # what the peer's server lends it

    @property
    def place(self) -> StagePlace:
        return self.state.place
