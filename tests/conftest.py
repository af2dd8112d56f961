"""Shared fixtures of every test package: offline Hugging Face, hypothesis profile, seeds, and the
in-process swarm (tests/_swarm_env.py). The helper modules beside this file (_util, _swarm_env,
_codec_cases, _feedback_cases) are importable from every test package."""

from __future__ import annotations

import os
import signal
import sys

# Tests never reach outside the machine: the Hugging Face libraries stay offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch thread here and in every process a test starts (peers, labs, CLIs): pytest-xdist runs
# two workers on this 2-core machine, and a thread per core in each process oversubscribed the
# cores several times over (the suite's main slowness). Swarm and single-process runs then also
# compute with the same thread count, as their equality needs.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

settings.register_profile(
    "hivepipe",
    deadline=None,
    max_examples=100,
    derandomize=True,  # the same examples on every run: failures are reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("hivepipe")

torch.set_num_threads(1)

from _peers_marker import WATCH, fail_if_started, mark_collected  # noqa: E402

WATCH.install()


def pytest_collection_modifyitems(config, items):
    mark_collected(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    WATCH.arm(item)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        result = yield
    finally:
        started = WATCH.disarm()
    fail_if_started(item, started)
    return result


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _sigint_as_inherited():
    """A peer's main() run in this process sets its own Ctrl-C handler: the next tests' processes
    inherit SIGINT as the suite did (ignored, when the suite runs in a script's background)."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not handler and handler is not None:
        signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="session")
def swarm():
    """A swarm on real hivemind in this process (see _swarm_env), shared by every test: starting
    one costs about 6 s of daemons and DHT nodes, and an idle one uses 0.5% of a core. A test's runs
    have run ids of their own and leave the shared hosts as they found them (`Swarm.unhost`)."""
    from _swarm_env import Swarm

    env = Swarm()
    yield env
    env.close()
