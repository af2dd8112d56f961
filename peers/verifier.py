"""`python -m peers.verifier --stage N --identity_path KEY --initial_peers ...`: a verifier the run's
owner trusts, for one stage.

It is a stage peer (every option of `python -m peers.stage`) that serves its stage like a replica,
its weights kept equal to the others' by their averaging, but is handed a micro-batch only when the
owner checks another peer's result (`train.verify`): so a stage served by one peer is checked too.
The owner names it by its peer id in the run's config, `train.verifiers: [PEER_ID]`; it keeps its
identity file for that (`--print_id` prints the peer id of KEY, created if missing, and exits).
"""

from __future__ import annotations

import sys

from peers._common import fail, say
from peers.stage import main as stage_main
from swarm.transport.hivemind.trust.keys import IdentityError, load_identity, own_peer_id


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    printing = "--print_id" in argv
    if printing:
        argv.remove("--print_id")
    path = _identity_path(argv)
    if path is None:
        return fail("a verifier keeps its peer id, which the owner lists in train.verifiers: give --identity_path KEY")
    try:
        peer_id = own_peer_id(load_identity(path))
    except IdentityError as e:
        return fail(f"--identity_path: {e}")
    if printing:
        say(peer_id)
        return 0
    say(f"verifier {peer_id}: it takes micro-batches only when the owner lists it in train.verifiers")
    return stage_main(argv)


def _identity_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--identity_path" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--identity_path="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    sys.exit(main())
