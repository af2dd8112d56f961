"""What produced each result (its stamp: commit, torch version, threads), and the rule that one
table holds the results of one commit unless told otherwise.

Results files written before stamps existed have none: they count as commit "unstamped", one group.
"""

from __future__ import annotations

from collections import Counter

UNSTAMPED = "unstamped"


class MixedCommits(ValueError):
    """A table would hold results of different commits."""


def commit_of(run: dict) -> str:
    return (run.get("stamp") or {}).get("commit") or UNSTAMPED


def measured(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r["state"] != "pending"]


def commits(runs: list[dict]) -> list[str]:
    """The commits of a table's measured runs, most runs first."""
    return [c for c, _ in Counter(commit_of(r) for r in measured(runs)).most_common()]


def check_one_commit(title: str, runs: list[dict], mix: bool) -> None:
    found = commits(runs)
    if len(found) > 1 and not mix:
        raise MixedCommits(
            f"{title}: results of {len(found)} commits ({', '.join(found)}) in one table; "
            "rerun the odd ones on one commit, or pass --mix_commits to show them together"
        )


def stamp_line(runs: list[dict]) -> str:
    """Which commit, torch version and thread count produced a table's results, and how many runs each."""
    groups = Counter(
        (commit_of(r), (r.get("stamp") or {}).get("torch"), (r.get("stamp") or {}).get("threads"))
        for r in measured(runs)
    )
    parts = []
    for (commit, torch, threads), n in groups.most_common():
        if commit == UNSTAMPED:
            parts.append(f"{n} run(s) unstamped (written before results recorded their commit, torch and threads)")
        else:
            parts.append(f"{n} run(s) of commit {commit}, torch {torch}, {threads} thread(s)")
    return "Produced by: " + "; ".join(parts) + "." if parts else ""
