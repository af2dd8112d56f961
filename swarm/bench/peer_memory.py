"""`python -m swarm.bench.peer_memory [--every S] [--out FILE] -- COMMAND...`: what a swarm's peers
hold in memory while COMMAND (say `python -m swarm lab ...`) runs.

Every `--every` seconds it reads /proc/PID/smaps_rollup of each hivepipe peer process COMMAND
started (`python -m peers.stage`, `peers.trainer`, `peers.bootstrap`) and of each p2p daemon, the
daemon counted under its peer (a peer leads its process group; hivemind starts p2pd in it). RSS
counts the pages of torch's libraries that every peer maps from the same files; PSS shares them
out; private is what one peer adds (what N peers cost is about N x private + shared once). At the
end it prints each peer's peak and, with `--out`, writes every sample as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass

from swarm.netlab.counters import proc_stats

PEER_MODULES = ("peers.stage", "peers.trainer", "peers.bootstrap")
FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty")


@dataclass
class Memory:
    """MiB of one process, or a peer and its daemon summed."""

    rss: float = 0.0
    pss: float = 0.0
    private: float = 0.0

    def __add__(self, other: Memory) -> Memory:
        return Memory(self.rss + other.rss, self.pss + other.pss, self.private + other.private)


def memory_of(pid: int) -> Memory | None:
    """/proc/PID/smaps_rollup in MiB; None once the process is gone."""
    values = dict.fromkeys(FIELDS, 0.0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) / 1024
    except (OSError, ValueError):
        return None
    return Memory(values["Rss"], values["Pss"], values["Private_Clean"] + values["Private_Dirty"])


def peer_label(pid: int) -> str | None:
    """`stage1 PID`, `trainer PID`, `bootstrap PID` for a hivepipe peer process, else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for module in PEER_MODULES:
        if module in args:
            role = module.split(".")[1]
            if role == "stage" and "--stage" in args:
                role += args[args.index("--stage") + 1]
            return f"{role} {pid}"
    return None


def sample(root: int) -> dict[str, dict[str, Memory]]:
    """{peer label: {"peer": Memory, "daemon": Memory}} of every hivepipe peer process `root`
    started (its descendants: other swarms on this machine are not counted)."""
    groups, parents = _groups()
    labels = {pgid: label for pgid in groups if (label := peer_label(pgid)) and _descends(pgid, root, parents)}
    return {labels[pgid]: found for pgid, found in _group_memory(groups, labels).items()}


def sample_groups(pgids) -> dict[int, dict[str, Memory]]:
    """{pgid: {"peer": Memory, "daemon": Memory}} of the peers leading these process groups (a lab's
    peers, which it knows by pid; a forked peer's command line is its spawner's), gone ones left out."""
    return _group_memory(_groups()[0], set(pgids))


def _groups() -> tuple[dict[int, list[tuple[int, str]]], dict[int, int]]:
    """({pgid: [(pid, command name)]}, {pid: parent pid}) of every process on the machine."""
    groups: dict[int, list[tuple[int, str]]] = {}
    parents: dict[int, int] = {}
    for pid, comm, fields in proc_stats():
        groups.setdefault(int(fields[2]), []).append((pid, comm))
        parents[pid] = int(fields[1])
    return groups, parents


def _group_memory(groups: dict[int, list[tuple[int, str]]], leaders) -> dict[int, dict[str, Memory]]:
    """Each leader's own memory and its group's p2p daemons' (hivemind starts p2pd in the peer's group)."""
    found = {}
    for pgid in leaders:
        peer = memory_of(pgid)
        if peer is None or pgid not in groups:
            continue
        daemon = Memory()
        for pid, comm in groups[pgid]:
            if comm == "p2pd" and (memory := memory_of(pid)) is not None:
                daemon += memory
        found[pgid] = {"peer": peer, "daemon": daemon}
    return found


def _descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = parents.get(pid, 0)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.bench.peer_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--out", help="write every sample here (JSON lines)")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- the command to run (e.g. python -m swarm lab ...)"
    )
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not args.every > 0:
        parser.error("give a positive --every and a command after --")
    peaks: dict[str, dict[str, Memory]] = {}
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 (open for the whole run)
    process = subprocess.Popen(command)
    try:
        while process.poll() is None:
            now = sample(process.pid)
            if out is not None:
                rows = {label: {part: vars(m) for part, m in parts.items()} for label, parts in now.items()}
                out.write(json.dumps({"at": time.time(), "peers": rows}) + "\n")
            for label, parts in now.items():
                peak = peaks.setdefault(label, {"peer": Memory(), "daemon": Memory()})
                for part, memory in parts.items():
                    old = peak[part]
                    peak[part] = Memory(
                        max(old.rss, memory.rss), max(old.pss, memory.pss), max(old.private, memory.private)
                    )
            time.sleep(args.every)
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait()
        if out is not None:
            out.close()
    print("peak MiB per peer: rss / pss / private (peer), rss / private (its p2pd)", file=sys.stderr)
    for label, peak in sorted(peaks.items()):
        peer, daemon = peak["peer"], peak["daemon"]
        print(
            f"  {label:18} {peer.rss:6.0f} / {peer.pss:6.0f} / {peer.private:6.0f}   {daemon.rss:5.0f} / {daemon.private:5.0f}",
            file=sys.stderr,
        )
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
