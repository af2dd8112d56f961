"""A peer imports hivemind without the parts it never uses (swarm.transport.hivemind.lean), and
code that asks for the whole library still gets it."""

from __future__ import annotations

import subprocess
import sys

from _util import REPO

CHECK = """
import sys
import peers.stage, swarm.transport.hivemind.stage.averaging  # a stage peer's imports, all-reduce included
skipped = [m for m in ("scipy", "hivemind.moe", "hivemind.optim", "hivemind.averaging.averager") if m in sys.modules]
import hivemind
from hivemind.averaging import DecentralizedAverager
print(skipped, hivemind.DHT.__name__, hivemind.__version__ != "", DecentralizedAverager.__name__, "scipy" in sys.modules)
"""


def test_a_peer_skips_hiveminds_averager_optimizers_and_experts_until_asked():
    # a new interpreter: this one may have imported all of hivemind already
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "DHT", "True", "DecentralizedAverager", "True"], done.stdout
