"""A run's config published in the DHT (swarm.transport.hivemind.dht.runconfig) and a stage peer that
joins with it (peers.stage without --config), on real hivemind (loopback)."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest
import torch
from _swarm_env import SETTINGS, stage_errors
from _util import REPO, SMOKE
from hivemind.utils import get_dht_time

from swarm.config import ConfigError, config_from_text, load_config
from swarm.engine.build import config_digest
from swarm.transport.hivemind.dht.announce import list_run, list_runs
from swarm.transport.hivemind.dht.runconfig import (
    ConfigPublisher,
    PublishedConfig,
    RunConfigError,
    config_key,
    fetch_configs,
    publish,
    resolve_run,
    start_publishing,
)
from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
from swarm.transport.hivemind.net.settings import Settings

TEXT = SMOKE.read_text()


def fresh_run() -> str:
    return f"rc-{uuid.uuid4().hex[:8]}"


def published(run_id: str, *overrides: str) -> PublishedConfig:
    return PublishedConfig.of(run_id, TEXT, list(overrides), str(SMOKE))


@pytest.fixture
def lonely(swarm):
    """A DHT of its own, one node that is its own bootstrap: no other test's runs are on it."""
    node = swarm.loop.run(SwarmNode.create(NodeOptions(settings=SETTINGS)))
    yield node
    swarm.loop.run(node.shutdown())


def test_config_from_text_fails_in_one_line(tmp_path):
    cases = {
        "a: [1, 2": "where: not valid YAML",
        "- 1\n- 2\n": "where: the top level must be a mapping",
        "model:\n  num_stages: 0\n": "model.num_stages:",
        "compression:\n  forward: topk:reuse\n": "config: compression (boundary 0): topk:reuse",
    }
    for text, start in cases.items():
        with pytest.raises(ConfigError) as e:
            config_from_text(text, [], "where")
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"^--set expects key=value, got 'nokey'$"):
        config_from_text(TEXT, ["nokey"], "where")
    # load_config names the file as before
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2")
    with pytest.raises(ConfigError, match=rf"^{broken}: not valid YAML: expected .* \(line 1, column 9\)$"):
        load_config(broken)
    assert config_from_text("", ["optimizer.lr=0.5"], "x") == load_config(None, ["optimizer.lr=0.5"])
    assert config_from_text(TEXT, ["seed=3"], "x") == load_config(SMOKE, ["seed=3"])


def test_publish_and_resolve_round_trip(swarm):
    run_id = fresh_run()
    overrides = ["model.num_stages=2", "optimizer.lr=0.02"]
    mine = published(run_id, *overrides)
    host = swarm.hosts[0][0]
    publisher = swarm.loop.run(start_publishing(host, mine))
    try:
        found = swarm.loop.run(resolve_run(swarm.trainer, run_id, 5))
        assert found == mine and found.num_stages == 2 and found.overrides == overrides
        cfg = found.config()
        assert config_digest(cfg) == found.digest == config_digest(load_config(SMOKE, overrides))
        assert cfg.optimizer.lr == 0.02 and cfg.model.num_stages == 2
        assert found.config(["device=cuda"]).device == "cuda"  # a peer's own device keeps the digest
        with pytest.raises(ConfigError, match="digest"):  # anything else that changes it does not
            found.config(["seed=7"])
        # listed as a run before any stage announced
        assert swarm.loop.run(list_runs(swarm.trainer))[run_id] == 2
    finally:
        swarm.loop.run(publisher.stop())


def test_a_publisher_refreshes_its_record_until_stopped(swarm):
    run_id = fresh_run()
    node = swarm.loop.run(SwarmNode.create(swarm.options(settings=Settings.of(announce_every_s=0.2, record_ttl_s=1.0))))
    try:
        publisher = ConfigPublisher(node, run_id, published(run_id))

        async def started():
            await publisher.publish_now()
            publisher.start()

        swarm.loop.run(started())
        time.sleep(2.0)  # twice the records' lifetime: only the refreshes keep it
        assert [c.run_id for c in swarm.loop.run(fetch_configs(swarm.trainer, run_id))] == [run_id]
        swarm.loop.run(publisher.stop())
        time.sleep(1.5)
        assert swarm.loop.run(fetch_configs(swarm.trainer, run_id)) == []
    finally:
        swarm.loop.run(node.shutdown())


def test_resolve_waits_for_a_config_to_appear(swarm):
    run_id = fresh_run()
    mine = published(run_id)

    async def late():
        await asyncio.sleep(1.0)
        await publish(swarm.hosts[1][0], run_id, mine, 10)

    async def both():
        return (await asyncio.gather(resolve_run(swarm.trainer, run_id, 10), late()))[0]

    start = time.monotonic()
    assert swarm.loop.run(both()) == mine
    assert 1.0 <= time.monotonic() - start < 5


def test_without_a_run_id_one_run_is_joined_and_several_are_listed(swarm, lonely):
    a, b = "demo-a", "demo-b"
    swarm.loop.run(publish(lonely, a, published(a), 30))
    # a run listed by a stage's announcement without a published config does not count
    assert swarm.loop.run(list_run(lonely, "stage-only", 3, get_dht_time() + 30))
    assert "stage-only" in swarm.loop.run(list_runs(lonely))
    assert swarm.loop.run(resolve_run(lonely, None, 1)).run_id == a
    swarm.loop.run(publish(lonely, b, published(b, "model.num_stages=2"), 30))
    with pytest.raises(RunConfigError) as e:
        swarm.loop.run(resolve_run(lonely, None, 1))
    assert str(e.value) == "2 runs on this DHT: demo-a (4 stages), demo-b (2 stages); pick one with --run_id"
    assert swarm.loop.run(resolve_run(lonely, b, 1)).num_stages == 2


def test_two_configs_for_one_run_are_refused(swarm):
    run_id = fresh_run()
    one, two = published(run_id), published(run_id, "seed=1")
    for record in (one, two):
        swarm.loop.run(publish(swarm.hosts[2][0], run_id, record, 30))
    with pytest.raises(RunConfigError) as e:
        swarm.loop.run(resolve_run(swarm.trainer, run_id, 1))
    message = str(e.value)
    assert "\n" not in message and one.digest in message and two.digest in message and "--config" in message
    # a peer with a third config refuses to join; one with either of the two joins
    third = published(run_id, "seed=2")
    with pytest.raises(RunConfigError) as e:
        swarm.loop.run(start_publishing(swarm.trainer, third))
    assert str(e.value) == (
        f"--config differs from run {run_id}'s published config: "
        f"digest {third.digest} here, {', '.join(sorted([one.digest, two.digest]))} published"
    )
    swarm.loop.run(swarm.loop.run(start_publishing(swarm.trainer, one)).stop())


def test_no_config_fails_after_the_wait(swarm, lonely):
    start = time.monotonic()
    with pytest.raises(RunConfigError, match=r"^no run on this DHT published its config within 1s: "):
        swarm.loop.run(resolve_run(lonely, None, 1))
    assert time.monotonic() - start >= 1
    run_id = fresh_run()
    with pytest.raises(RunConfigError, match=rf"^run '{run_id}' published no config within 1s: "):
        swarm.loop.run(resolve_run(swarm.trainer, run_id, 1))


GOOD = {"yaml": "seed: 0\n", "overrides": [], "digest": "d", "num_stages": 4}
MALFORMED = [
    "text",
    None,
    [1, 2],
    {**GOOD, "yaml": 3},
    {**GOOD, "overrides": "seed=1"},
    {**GOOD, "overrides": [1]},
    {**GOOD, "digest": ""},
    {**GOOD, "num_stages": True},
    {**GOOD, "num_stages": 0},
    {**GOOD, "num_stages": "4"},
    {k: v for k, v in GOOD.items() if k != "yaml"},
]


def test_malformed_records_are_ignored(swarm):
    for value in MALFORMED:
        assert PublishedConfig.from_value("r", value) is None, value
    assert PublishedConfig.from_value("r", GOOD) == PublishedConfig("r", "seed: 0\n", [], "d", 4)
    run_id = fresh_run()
    mine = published(run_id)
    node = swarm.hosts[3][0]
    expires = get_dht_time() + 30
    for i, value in enumerate(MALFORMED):
        if value is not None:  # hivemind stores no None
            swarm.loop.run(node.dht.store(config_key(run_id), value, expires, subkey=f"junk{i}"))
    # well formed, but not under its own digest
    swarm.loop.run(node.dht.store(config_key(run_id), mine.to_value(), expires, subkey="elsewhere"))
    swarm.loop.run(publish(node, run_id, mine, 30))
    raw = swarm.loop.run(swarm.trainer.dht.get(config_key(run_id), latest=True)).value
    assert len(raw) == len(MALFORMED) + 1  # the junk is there to be ignored
    assert swarm.loop.run(fetch_configs(swarm.trainer, run_id)) == [mine]
    assert swarm.loop.run(resolve_run(swarm.trainer, run_id, 1)) == mine


def test_a_published_config_that_does_not_rebuild_fails_in_one_line():
    liar = PublishedConfig("r", TEXT, [], "0123456789abcdef", 4)
    with pytest.raises(ConfigError, match=r"^run 'r''s published config gives digest \w+ here, 0123456789abcdef"):
        liar.config()
    for text in ("a: [1, 2", "model: {num_stages: 0}\n"):
        with pytest.raises(ConfigError) as e:
            PublishedConfig("r", text, [], "d", 4).config()
        assert str(e.value).startswith("run 'r''s published config: ") and "\n" not in str(e.value)


def stage_peer(maddrs: list[str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "peers.stage", "--stage", "0", "--initial_peers", *maddrs, "--threads", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_a_stage_peer_without_a_published_config_fails_in_one_line(swarm, lonely):
    maddrs = swarm.loop.run(lonely.maddrs())
    peer = stage_peer(maddrs, "--wait", "2")
    _, err = peer.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert peer.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: no run on this DHT published its config within 2s: "), err


def test_a_stage_peer_joins_with_the_published_config(swarm, lonely, capsys):
    run_id = fresh_run()
    mine = published(run_id, "model.num_stages=2")
    swarm.loop.run(publish(lonely, run_id, mine, 60))
    maddrs = swarm.loop.run(lonely.maddrs())
    assert stage_errors(capsys, swarm.loop, "--initial_peers", *maddrs, "--set", "seed=1") == [
        "error: --set needs --config: without it the run's config is fetched as published"
    ]
    # with a --config of another digest it refuses to join
    assert stage_errors(capsys, swarm.loop, "--initial_peers", *maddrs, "--config", str(SMOKE), "--run_id", run_id) == [
        f"error: --config differs from run {run_id}'s published config: "
        f"digest {published(run_id).digest} here, {mine.digest} published"
    ]
    assert stage_errors(capsys, swarm.loop, "--initial_peers", *maddrs, "--stage", "2") == [
        "error: --stage 2 does not exist: the config has 2 stages (0..1)"
    ]
    assert stage_errors(capsys, swarm.loop, "--initial_peers", *maddrs, "--wait", "-1") == [
        "error: --wait must be a number of seconds (0 or more), got -1.0"
    ]
    # a device this machine lacks: refused at start, not at the run's setup (which it would fail)
    missing = f"cuda:{torch.cuda.device_count()}"
    (line,) = stage_errors(capsys, swarm.loop, "--initial_peers", *maddrs, "--device", missing)
    assert line.startswith(f"error: device {missing}: this machine has "), line
    peer = stage_peer(maddrs, "--wait", "10")
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in peer.stdout:
            lines.put(line)
        lines.put(None)  # it exited

    threading.Thread(target=read, daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + 60
        while not any(" serving as " in line for line in seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"the peer exited: {seen} {peer.stderr.read()}"
            seen.append(line)
    finally:
        peer.terminate()
        code = peer.wait(timeout=30)
    assert seen[0].strip() == f"joined run {run_id!r}: config {mine.digest} as published on the DHT"
    assert seen[-1].startswith(f"stage 0/2 of run {run_id!r} serving as ")
    # 0 once its SIGTERM handler is in place; a SIGTERM just after the line may still beat it
    assert code in (0, -signal.SIGTERM)


def test_the_trainer_publishes_its_config_for_the_run_and_its_metrics_outlive_the_run(swarm, lonely):
    """No stage peer ever comes, so the run fails; with --metrics_linger its metrics stay up after
    the error (a scraper sees the end of a short run) until a Ctrl-C cuts the wait short, though the
    trainer was started as a script's background job is, with SIGINT ignored."""
    run_id = fresh_run()
    maddrs = swarm.loop.run(lonely.maddrs())
    trainer = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]  # SIGINT ignored, as in a script's background job
        + [sys.executable, "-m", "peers.trainer", "--config", str(SMOKE), "--set", "seed=3", "--run_id", run_id]
        + ["--initial_peers", *maddrs, "--threads", "1", "--wait", "3"]
        + ["--metrics_port", "0", "--metrics_linger", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    out: list[str] = []
    lingering = threading.Event()

    def read() -> None:
        for line in trainer.stdout:
            out.append(line)
            if "(--metrics_linger)" in line:
                lingering.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        found = swarm.loop.run(resolve_run(lonely, None, 60))
        assert lingering.wait(90), "".join(out)
        url = next(line.split("metrics at ")[1].strip() for line in out if "metrics at " in line)
        scraped = urllib.request.urlopen(url, timeout=10).read().decode()  # after the run's end
        assert trainer.poll() is None
    finally:
        trainer.send_signal(signal.SIGINT)
        err = trainer.communicate(timeout=60)[1]  # far less than the 600 s it would have waited
        reader.join(10)
    assert "hivepipe_trainer_step" in scraped and "process_resident_memory_bytes" in scraped
    owner, found.owner = found.owner, ""  # signed by the run's owner, whose id the trainer prints
    assert found == published(run_id, "seed=3")
    assert f"owner of run {run_id!r}: {owner}" in "".join(out)
    assert trainer.returncode == 2 and err.strip().splitlines()[-1].startswith("error: "), err  # no stage peers
