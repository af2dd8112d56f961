"""The owner's manifests of the swarm's copies (swarm.transport.hivemind.stage.snapshots).

After a snapshot round the trainer signs which copies it took: the SHA-256 of each stage's copies
at that step. Stage peers keep the manifests with their copies and show them in their status, so a
new trainer of the same owner, which knows nothing of the run but what the swarm tells it, restores
only copies the owner's manifest names: a peer that announces itself with copies of its own making
(any weights it likes) is never restored from, and a restoring peer refuses a downloaded copy whose
hash the manifest does not list.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.trust.sealed import MANIFEST, seal, signer

KEEP = 4  # manifests a peer keeps of its lineage (it keeps copies of the newest 2 steps per stage)


def digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


def make(key, run_id: str, lineage: str, step: int, hashes: dict[int, set[bytes]]) -> pb.CopyManifest:
    """The owner's signed manifest of `step`'s copies: `hashes` per stage."""
    stages = [pb.StageCopies(stage=stage, sha256=sorted(found)) for stage, found in sorted(hashes.items())]
    return seal(key, pb.CopyManifest(run_id=run_id, lineage=lineage, step=step, stages=stages), MANIFEST)


def owned(manifest: pb.CopyManifest, owner: str | None, run_id: str) -> bool:
    """Whether `manifest` is signed by `owner` for `run_id`."""
    if owner is None or manifest.run_id != run_id:
        return False
    try:
        return signer(manifest, MANIFEST) == owner
    except ValueError:
        return False


def accepted(manifests, owner: str, run_id: str) -> dict[tuple[str, int], dict[int, set[bytes]]]:
    """Of `manifests` (anyone's word of them), those `owner` signed for `run_id`: (lineage, step) ->
    stage -> the SHA-256s its copies may have."""
    out: dict[tuple[str, int], dict[int, set[bytes]]] = defaultdict(lambda: defaultdict(set))
    for manifest in manifests:
        if owned(manifest, owner, run_id):
            for entry in manifest.stages:
                out[(manifest.lineage, int(manifest.step))][int(entry.stage)].update(entry.sha256)
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
