"""The owner's manifests of the swarm's copies (swarm.transport.hivemind.stage.snapshots).

After a snapshot round the trainer signs which copies it took: the SHA-256 of each stage's copies
at that step. Stage peers keep the manifests with their copies and show them in their status, so a
new trainer of the same owner, which knows nothing of the run but what the swarm tells it, restores
only copies the owner's manifest names: a peer that announces itself with copies of its own making
(any weights it likes) is never restored from, and a restoring peer refuses a downloaded copy whose
hash the manifest does not list.

A copy's hash is its peer's word, and each peer's copy differs (its links, its RNG, BatchNorm's
running statistics). What a stage's replicas hold alike, bit for bit, is their parameters and
optimizer state (they sum their gradients with one all-reduce): each peer reports that digest too,
the manifest names the one most of the stage's peers report (a tie: the earliest admitted's) and
only the copies of the peers that report it, and a restoring peer checks the digest inside the copy
it installs. A member whose copy holds weights of its own is outvoted by its replicas; one that
reports their digest over a copy of other weights is caught on restore.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.trust.sealed import MANIFEST, seal, signer

KEEP = 4  # manifests a peer keeps of its lineage (it keeps copies of the newest 2 steps per stage)


SHARED = ("module", "optimizer", "scheduler", "delay")  # a stage file's parts its replicas hold alike
PARAMETERS = "parameters"  # a copy's key naming its module's parameters (the rest are buffers)


@dataclass
class Named:
    """What a manifest names of one stage's copies: their SHA-256s and the digest of the parameters
    and optimizer state inside them (empty: not checked, a manifest of before it was kept)."""

    copies: set[bytes] = field(default_factory=set)
    weights: bytes = b""


def digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


def weights_digest(saved: dict) -> bytes:
    """SHA-256 of what a stage's replicas hold alike in its stage file `saved`: the module's
    parameters, as its "parameters" names them (not its buffers: BatchNorm's running statistics
    follow each peer's micro-batches; the names are hashed too, so a copy cannot drop a tensor by
    leaving its name out), the optimizer's and scheduler's state and the async schedule's held
    gradients. Any peer can check it: a holder of a neighbour stage's copy too."""
    shared = {part: saved.get(part) for part in SHARED}
    parameters = saved.get(PARAMETERS)
    names = set(parameters) if isinstance(parameters, list | tuple) else set(shared["module"] or ())
    shared["module"] = {name: t for name, t in (shared["module"] or {}).items() if name in names}
    shared[PARAMETERS] = sorted(names)
    h = hashlib.sha256()
    _feed(h, shared)
    return h.digest()


def _feed(h, value) -> None:
    """Feeds `value` (tensors, dicts, lists and plain values, nested) to `h`, unambiguously."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # its buffer, not a copy
    elif isinstance(value, dict):
        h.update(f"D{len(value)}|".encode())
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(f"L{len(value)}|".encode())
        for item in value:
            _feed(h, item)
    else:
        text = repr(value).encode()
        h.update(f"S{len(text)}|".encode() + text)


def agreed(reports: list[tuple[str, bytes, bytes]]) -> tuple[Named, list[str]]:
    """Of one stage's peers' (peer, copy SHA-256, weights digest) in admission order: what the
    manifest names (the weights most report, a tie going to the earliest), and the peers outvoted."""
    counts = Counter(weights for _, _, weights in reports)
    first = {}
    for index, (_, _, weights) in enumerate(reports):
        first.setdefault(weights, index)
    chosen = max(counts, key=lambda weights: (counts[weights], -first[weights]))
    named = Named({sha for _, sha, weights in reports if weights == chosen}, chosen)
    return named, [peer for peer, _, weights in reports if weights != chosen]


def make(key, run_id: str, lineage: str, step: int, named: dict[int, Named]) -> pb.CopyManifest:
    """The owner's signed manifest of `step`'s copies: what it names per stage."""
    stages = [
        pb.StageCopies(stage=stage, sha256=sorted(n.copies), weights_sha256=n.weights)
        for stage, n in sorted(named.items())
    ]
    return seal(key, pb.CopyManifest(run_id=run_id, lineage=lineage, step=step, stages=stages), MANIFEST)


def owned(manifest: pb.CopyManifest, owner: str | None, run_id: str) -> bool:
    """Whether `manifest` is signed by `owner` for `run_id`."""
    if owner is None or manifest.run_id != run_id:
        return False
    try:
        return signer(manifest, MANIFEST) == owner
    except ValueError:
        return False


def accepted(manifests, owner: str, run_id: str) -> dict[tuple[str, int], dict[int, Named]]:
    """Of `manifests` (anyone's word of them), those `owner` signed for `run_id`: (lineage, step) ->
    stage -> what it names of the stage's copies."""
    out: dict[tuple[str, int], dict[int, Named]] = defaultdict(lambda: defaultdict(Named))
    for manifest in manifests:
        if owned(manifest, owner, run_id):
            for entry in manifest.stages:
                named = out[(manifest.lineage, int(manifest.step))][int(entry.stage)]
                named.copies.update(entry.sha256)
                named.weights = named.weights or bytes(entry.weights_sha256)
    return out


class Kept:
    """The manifests one hosted stage keeps (of its copies' lineage, newest `KEEP` steps)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._kept: dict[int, pb.CopyManifest] = {}  # step -> manifest

    def keep(self, manifest: pb.CopyManifest, owner: str | None, lineage: str) -> bool:
        """Keeps `manifest` if the owner signed it for this run and lineage; whether it did."""
        if manifest.lineage != lineage or not owned(manifest, owner, self.run_id):
            return False
        self._kept[int(manifest.step)] = manifest
        for step in sorted(self._kept)[:-KEEP]:
            del self._kept[step]
        return True

    def all(self) -> list[pb.CopyManifest]:
        return [self._kept[step] for step in sorted(self._kept)]

    def clear(self) -> None:
        self._kept.clear()
