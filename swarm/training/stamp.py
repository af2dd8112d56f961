"""What produced a result: the code's commit, the torch version and the torch thread count.

Written into every results file's config row (`"stamp"`), so a report can tell results of
different code apart (`swarm.study.stamps`). Outside a git checkout the commit is "unknown":
stamping never stops a run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

UNKNOWN = "unknown"


def commit(where: str | Path | None = None) -> str:
    """`git describe --always --dirty` of the checkout holding this package (or `where`)."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):  # no git, or a hung one: the run matters more
        return UNKNOWN
    if done.returncode != 0:  # not a checkout (an installed copy, an exported tree)
        return UNKNOWN
    return done.stdout.strip() or UNKNOWN


def stamp() -> dict:
    return {"commit": commit(), "torch": torch.__version__, "threads": torch.get_num_threads()}
