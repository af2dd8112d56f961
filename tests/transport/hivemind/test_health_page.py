"""The health page and the metrics endpoints as a user meets them: a swarm of separate processes
(bootstrap, two stage peers, a trainer, each with --metrics_port) and `peers.status --serve`,
the page loaded in Debian's headless Chromium (installed by the test's setup when missing)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from _browser import chromium_page, ensure_chromium, expect
from _util import REPO, SMOKE

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

CONFIG = [
    "--config",
    str(SMOKE),
    "--set",
    "model.num_stages=2",
    "--set",
    "train.epochs=400",
    "--set",
    "train.eval_every=100",
]
LOCAL = ["--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--threads", "1"]
# Whether the number an element of the page shows ("1,234" too) is above a floor: wait_for_function's arg.
NUMBER_ABOVE = "([selector, floor]) => Number(document.querySelector(selector)?.textContent.replace(/,/g, '')) > floor"


class Peer:
    """A peer process whose output lines are collected as they come."""

    def __init__(self, name: str, *args: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # SIGINT reaches it even though the test runs in the background
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_line(self, pattern: str, timeout: float = 90.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.proc.poll() is not None and not any(re.search(pattern, line) for line in self.lines):
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name} never printed /{pattern}/; it printed:\n" + "\n".join(self.lines[-30:]))


def stop_all(peers: list[Peer]) -> None:
    """SIGTERM to every peer, again to those still there (a stage peer's second signal skips
    draining), then SIGKILL to what is left of each one's process group."""
    for wait_s in (3.0, 15.0):
        alive = [p for p in peers if p.proc.poll() is None]
        for peer in alive:
            peer.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        for peer in alive:
            try:
                peer.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for peer in peers:
        if peer.proc.poll() is None:
            os.killpg(peer.proc.pid, signal.SIGKILL)
            peer.proc.wait(10)


def metrics(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def value(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"no {name} in the metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def chromium():
    return ensure_chromium()  # apt-get install chromium where it is missing (root); one line if it cannot


def test_the_health_page_shows_every_stage_and_keeps_up_and_every_peer_serves_metrics(chromium, capsys):
    peers: list[Peer] = []
    try:
        boot = Peer("bootstrap", "peers.bootstrap", *LOCAL[:2], "--metrics_port", "0")
        peers.append(boot)
        maddr = boot.wait_line(r"^(/ip4/127\.0\.0\.1/\S+/p2p/\S+)$").group(1)
        stages = [
            Peer(
                f"stage{s}",
                "peers.stage",
                "--stage",
                str(s),
                *CONFIG,
                "--initial_peers",
                maddr,
                *LOCAL,
                "--metrics_port",
                "0",
            )
            for s in (0, 1)
        ]
        peers += stages
        # started beside the stage peers, not after them: the trainer waits for the stages on the DHT
        trainer = Peer(
            "trainer", "peers.trainer", *CONFIG, "--initial_peers", maddr, "--threads", "1", "--metrics_port", "0"
        )
        status = Peer("status", "peers.status", "--initial_peers", maddr, "--serve", "0")
        peers += [trainer, status]
        ids = [stage.wait_line(r"serving as (\S+)").group(1) for stage in stages]
        trainer.wait_line(r"^step 3/")
        url = status.wait_line(r"health page at (http://\S+/)").group(1)
        # --json: the page's data once (its main in this process: no interpreter to start)
        from peers.status import main as status_main

        capsys.readouterr()
        assert status_main(["--initial_peers", maddr, "--json"]) == 0
        once = capsys.readouterr()
        (run,) = json.loads(once.out)["runs"]
        assert [[p["peer_id"] for p in s["peers"]] for s in run["stages"]] == [[ids[0]], [ids[1]]]

        with chromium_page() as page:
            page.goto(url)
            for stage, peer in enumerate(ids):  # each stage's column holds its peer's card
                page.wait_for_selector(f'[data-stage-column="{stage}"] [data-peer="{peer}"]', state="attached")
            step = page.locator("[data-field=step]")
            expect(step).to_have_text(re.compile(r"^\d+$"))
            first_step = int(step.inner_text())
            card = f'[data-peer="{ids[1]}"] [data-field=micro_batches]'
            batches = int(page.locator(card).inner_text().replace(",", ""))
            refreshes = int(page.locator("body").get_attribute("data-refreshes"))
            # it updates by itself: later data, a later step and more micro-batches, no reload
            page.evaluate("window.notReloaded = true")
            page.wait_for_function("n => Number(document.body.dataset.refreshes) > n", arg=refreshes + 1)
            page.wait_for_function(NUMBER_ABOVE, arg=["[data-field=step]", first_step])
            page.wait_for_function(NUMBER_ABOVE, arg=[card, batches])
            assert page.evaluate("window.notReloaded") is True
            text = page.inner_text("body")
            assert "training" in text and "setup" in text

        # every peer's metrics endpoint
        urls = {p.name: p.wait_line(r"metrics at (http://\S+)").group(1) for p in (boot, *stages, trainer)}
        assert value(metrics(urls["bootstrap"]), "hivepipe_dht_peers") >= 1
        for stage in (0, 1):
            text = metrics(urls[f"stage{stage}"])
            assert value(text, "hivepipe_stage_micro_batches_total") > 0
            assert value(text, "process_resident_memory_bytes") > 0
        text = metrics(urls["trainer"])
        assert value(text, "hivepipe_trainer_step") >= 3 and value(text, "hivepipe_trainer_samples_per_second") > 0
    finally:
        stop_all(peers)
