"""`python -m swarm export`: a run's trained model in the formats people load (swarm.export), from
a checkpoint directory or from a live swarm (the run's owner only):

    python -m swarm export runs/ck --out model/                       # the newest step in runs/ck
    python -m swarm export runs/ck/step-00000200 --out model/ --merge  # a LoRA run's adapters merged in
    python -m swarm export --initial_peers /ip4/.../p2p/... --run_id demo --out model/
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def add_parser(commands) -> None:
    export = commands.add_parser(
        "export",
        help="the trained model as a directory transformers loads (config, safetensors, tokenizer), from a checkpoint or a live swarm",
    )
    export.add_argument(
        "checkpoint",
        nargs="?",
        help="a checkpoint directory (--checkpoint_dir: its newest step) or one of its step-<N> directories",
    )
    export.add_argument("--out", required=True, help="write the model here (a directory, created if missing)")
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the adapters merged into the base weights (a plain model), not peft's adapter directory",
    )
    export.add_argument("--push_to_hub", metavar="REPO", help="then upload it to this Hugging Face Hub model repo")
    export.add_argument(
        "--config",
        help="the run's experiment YAML (default: the one its checkpoint saved, or its owner published)",
    )
    export.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --config: as the run had",
    )
    live = export.add_argument_group(
        "from a live swarm, instead of a checkpoint: the newest copies its stage peers keep (the run's owner only)"
    )
    live.add_argument("--initial_peers", nargs="+", default=[], help="multiaddrs of peers in the swarm")
    live.add_argument("--run_id", help="the run (default: the only one on the DHT)")
    live.add_argument(
        "--identity_path",
        help="the run owner's key, as its trainer was given it (default $HIVEPIPE_HOME or ~/.hivepipe/owner.key)",
    )
    live.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the DHT and each peer")


async def _from_swarm(args: argparse.Namespace, cfg):
    from swarm.export.live import live_state
    from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
    from swarm.transport.hivemind.net.settings import Settings
    from swarm.transport.hivemind.trust.keys import IdentityError, default_owner_path, load_identity

    try:
        owner_key = load_identity(args.identity_path or default_owner_path(), create=False)
    except IdentityError as e:
        raise ValueError(f"--identity_path: {e} (the run owner's key, the one its trainer runs with)") from None
    options = NodeOptions(initial_peers=list(args.initial_peers), client_mode=True, settings=Settings())
    node = await SwarmNode.create(options)
    try:
        return await live_state(node, args.run_id, owner_key, cfg, args.timeout)
    finally:
        await node.shutdown()


def _run_state(args: argparse.Namespace):
    from swarm.config import load_config
    from swarm.export.state import checkpoint_state

    if (args.checkpoint is None) == (not args.initial_peers):
        raise ValueError("give a CHECKPOINT directory or the --initial_peers of a live swarm (one of them)")
    if args.overrides and not args.config:
        raise ValueError("--set needs --config (a checkpoint's saved config has the run's overrides in it)")
    cfg = load_config(args.config, args.overrides) if args.config else None
    if args.checkpoint is not None:
        return checkpoint_state(args.checkpoint, cfg)
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    return asyncio.run(_from_swarm(args, cfg))


def run(args: argparse.Namespace) -> int:
    from swarm.export.exporter import ExportOptions, export_run

    options = ExportOptions(Path(args.out), args.merge, args.push_to_hub)
    try:
        options.check()  # before a checkpoint is read or a swarm reached
        lines = export_run(_run_state(args), options)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: the node, no config on the DHT
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
