"""`python -m peers.token --run_id RUN --peer PEER_ID [--expires 7d]`: let a peer into a private run.

Prints a token signed with the run owner's key (the trainer's `--identity_path`, default
~/.hivepipe/owner.key); the joiner starts with it: `python -m peers.stage --stage S --token TOKEN
--identity_path ITS_KEY ...` (the token names its peer id, so it keeps its key). `--peer_of KEY`
prints the peer id of an identity file (created if missing), for the joiner to send the owner.
"""

from __future__ import annotations

import argparse
import sys

from peers._common import fail, say
from swarm.transport.hivemind.trust.keys import (
    IdentityError,
    default_owner_path,
    is_peer_id,
    load_identity,
    own_peer_id,
)
from swarm.transport.hivemind.trust.tokens import issue_token, parse_duration


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m peers.token", description=__doc__.splitlines()[0])
    parser.add_argument("--run_id", help="the private run")
    parser.add_argument("--peer", help="the joiner's peer id (it prints it with --peer_of its identity file)")
    parser.add_argument("--expires", default=None, help="valid for this long, e.g. 12h, 7d (default: no expiry)")
    parser.add_argument(
        "--identity_path", default=None, help="the run owner's key (default: $HIVEPIPE_HOME or ~/.hivepipe/owner.key)"
    )
    parser.add_argument("--peer_of", metavar="KEY", help="print the peer id of this identity file and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.peer_of:
            say(own_peer_id(load_identity(args.peer_of)))
            return 0
        if not args.run_id or not args.peer:
            return fail("--run_id and --peer are needed (or --peer_of KEY)")
        if not is_peer_id(args.peer):
            return fail(f"--peer must be a peer id, got {args.peer!r}")
        expires = parse_duration(args.expires) if args.expires else None
        key = load_identity(args.identity_path or default_owner_path(), create=False)
    except ValueError as e:
        return fail(f"--expires: {e}")
    except IdentityError as e:
        return fail(str(e))
    say(issue_token(key, args.run_id, args.peer, expires))
    return 0


if __name__ == "__main__":
    sys.exit(main())
