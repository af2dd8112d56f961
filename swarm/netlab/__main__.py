"""`python -m swarm.netlab COMMAND`: the lab's small tools.

    detect [--json]                   what this kernel offers (netns, veth, bridge, tbf, netem, ifb)
    cleanup [--prefix hp]             delete namespaces left by crashed runs (owner pid dead)
    shape --dev eth0 [--rate 20mbit] [--delay 50ms] [--ingress] [--netem auto|yes|no] [--dry-run] [--clear]
          [--delay-left FILE]         shape this host's/container's own interface (Docker entrypoint);
                                      FILE gets the delay tc could not apply (no netem), for the peer
    identity PATH                     create a libp2p key if missing; print its peer id
    bootstrap-maddr --identity PATH --host NAME --port N [--wait S]
                                      /ip4/<NAME's address>/tcp/N/p2p/<id> once PATH exists
    port-open --port N [--host H]     exit 0 when a TCP connect succeeds (health checks)

Errors are one line on stderr: exit 2 for bad input, 1 for a failure of the system.
"""

from __future__ import annotations

import argparse
import json
import sys

from swarm.netlab.container import (
    Shell,
    bootstrap_maddr,
    clear_interface,
    ensure_identity,
    port_open,
    shape_interface,
)
from swarm.netlab.kernel import cleanup_stale, detect, require


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.netlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("detect", help="probe the kernel's namespace and qdisc support")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("cleanup", help="delete namespaces whose owner process is dead")
    p.add_argument("--prefix", default="hp")
    p = sub.add_parser("shape", help="shape one interface of this host or container")
    p.add_argument("--dev", default="eth0")
    p.add_argument("--rate", default=None, help="e.g. 20mbit, 500kbit, 1gbit")
    p.add_argument("--delay", default=None, help="one-way delay, e.g. 50ms (needs netem)")
    p.add_argument("--ingress", action="store_true", help="also shape what the interface receives (ifb)")
    p.add_argument(
        "--netem", choices=("auto", "yes", "no"), default="auto", help="auto: try netem when a delay is given, else tbf"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--clear", action="store_true", help="remove the shaping instead")
    p.add_argument(
        "--delay-left",
        default=None,
        metavar="FILE",
        help="write the delay not applied (no netem; empty if none) to FILE",
    )
    p = sub.add_parser("identity", help="create a libp2p key file if missing and print its peer id")
    p.add_argument("path")
    p = sub.add_parser("bootstrap-maddr", help="the bootstrap peer's multiaddr from its key file and host name")
    p.add_argument("--identity", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--wait", type=float, default=120.0)
    p = sub.add_parser("port-open", help="exit 0 when a TCP connection to the port succeeds")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)

    try:
        if args.command == "detect":
            caps = detect()
            print(json.dumps(caps.to_dict(), indent=1) if args.json else caps.summary())
            return 0 if caps.problem() is None else 1
        if args.command == "cleanup":
            require()
            removed = cleanup_stale(args.prefix)
            print(f"removed {len(removed)} stale namespace(s)" + (": " + ", ".join(removed) if removed else ""))
            return 0
        if args.command == "shape":
            if args.clear:
                clear_interface(args.dev, args.ingress, Shell(args.dry_run))
                return 0
            result = shape_interface(args.dev, args.rate, args.delay, args.ingress, args.netem, Shell(args.dry_run))
            print(("would shape " if args.dry_run else "shaped ") + result.describe(), flush=True)
            if args.delay_left:
                with open(args.delay_left, "w") as f:
                    f.write(result.delay_left)
            return 0
        if args.command == "identity":
            print(ensure_identity(args.path))
            return 0
        if args.command == "bootstrap-maddr":
            print(bootstrap_maddr(args.identity, args.host, args.port, args.wait))
            return 0
        if args.command == "port-open":
            return 0 if port_open(args.port, args.host) else 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
