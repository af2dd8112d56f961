"""swarm.lab.spawn: processes forked from one interpreter behave as `python -m MODULE` started anew,
followed through subprocess.Popen's interface (the lab's peers: tests/lab/test_lab.py and the rest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from swarm.lab.spawn import Spawner

pytestmark = pytest.mark.peers  # the spawning process is a new interpreter that imports hivepipe's peers

PIPED = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}


@pytest.fixture(scope="module")
def spawner():
    spawner = Spawner()
    yield spawner
    spawner.close()


def python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def test_a_module_reads_its_stdin_writes_its_output_and_exits_with_its_code(spawner):
    tool = spawner.popen(python("json.tool"), stdin=subprocess.PIPE, **PIPED)
    assert tool.communicate('{"a": [1]}', timeout=60) == ('{\n    "a": [\n        1\n    ]\n}\n', None)
    assert tool.returncode == 0
    missing = spawner.popen(python("json.tool", "/nonexistent.json"), **PIPED)
    out, _ = missing.communicate(timeout=60)
    assert missing.returncode == 2 and "No such file or directory" in out  # argparse's exit, its message


def test_a_child_has_its_own_session_the_environment_given_and_ends_by_its_signal(spawner):
    env = dict(os.environ, PYTHONUSERBASE="/spawned/base")
    site = spawner.popen(python("site", "--user-base"), env=env, **PIPED)
    assert site.communicate(timeout=60)[0] == "/spawned/base\n"
    for sig, code, said in ((signal.SIGINT, 0, "Keyboard interrupt received"), (signal.SIGKILL, -9, "")):
        server = spawner.popen(python("http.server", "0", "--bind", "127.0.0.1"), **PIPED)
        assert server.stdout.readline().startswith("Serving HTTP on 127.0.0.1")
        assert os.getpgid(server.pid) == server.pid != os.getpgid(0)  # a session of its own, as a peer needs
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=0.1)
        os.killpg(server.pid, sig)  # Ctrl-C reaches it as KeyboardInterrupt (the spawner ignores SIGINT)
        assert server.wait(timeout=60) == code and said in server.stdout.read()
        server.stdout.close()
