"""The slow-network lab's pieces on this machine's real kernel: namespaces, veths, a bridge and
tc; hivemind P2P streams measure what the links carry (never a mock)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from swarm.netlab.adaptive import AdaptiveCompression, topk_candidates
from swarm.netlab.bounds import compute_bound, fraction_of_bound, link_bound
from swarm.netlab.namespaces import NetLab, detect, list_namespaces
from swarm.netlab.probe import probe_in_process, probe_netlab
from swarm.netlab.rates import parse_delay, parse_rate
from swarm.netlab.shaper import TokenBucket

ROOT = Path(__file__).resolve().parents[1]


def test_this_machine_can_build_namespaces_and_says_what_it_lacks():
    caps = detect()
    assert caps.problem() is None, caps.problem()  # root, ip, tc, netns, veth, bridge, tbf are needed here
    assert "netem=" in caps.summary()


def test_namespaces_go_away_on_exit_on_an_exception_and_with_a_process_still_inside():
    before = set(list_namespaces("hp"))
    with pytest.raises(RuntimeError, match="boom"), NetLab(["a", "b"], rates="50mbit") as net:
        mine = set(net.namespaces())
        assert mine <= set(list_namespaces("hp"))
        assert net.address("a") in net.run("a", ["ip", "-o", "-4", "addr", "show", "eth0"], capture_output=True, text=True).stdout
        sleeper = subprocess.Popen(net.wrap("b", ["sleep", "600"]))  # still running at teardown
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=20) is not None
    assert set(list_namespaces("hp")) == before
    with NetLab(["a"]) as net:
        mine = set(net.namespaces())
    assert not mine & set(list_namespaces("hp"))


def test_a_killed_lab_leaves_nothing_behind_after_the_next_start():
    """SIGKILL skips every cleanup; the next NetLab removes the dead owner's namespaces first."""
    script = "from swarm.netlab.namespaces import NetLab\nimport time\nnet = NetLab(['x']).start()\nprint(net.tag, flush=True)\ntime.sleep(600)\n"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    tag = child.stdout.readline().strip()
    assert any(ns.startswith(tag) for ns in list_namespaces("hp"))
    child.kill()
    child.wait()
    with NetLab(["y"]) as net:
        assert tag not in " ".join(list_namespaces("hp")) and net.stale_removed
    assert not any(ns.startswith(tag) for ns in list_namespaces("hp"))


def test_shaping_limits_what_a_link_carries():
    nbytes = 3_000_000
    with NetLab(["a", "b", "c"], rates={"a": "1gbit", "b": "20mbit", "c": "1gbit"}) as net:
        assert "tbf 20mbit" in net.summary()
        shaped = probe_netlab(net, "a", ["b"], nbytes, directions=("up", "down"))["b"]
        fast = probe_netlab(net, "a", ["c"], nbytes, directions=("up",))["c"][0]
    for result in shaped:
        assert 12 < result.mbit_per_s <= 20.5, result  # libp2p payload under the 20 Mbit/s tbf, both directions
    assert fast.mbit_per_s > 3 * max(r.mbit_per_s for r in shaped)


def test_in_process_shaper_holds_its_rate():
    bucket = TokenBucket("20mbit")
    (result,) = asyncio.run(probe_in_process(4_000_000, bucket=bucket, directions=("up",)))
    assert result.mbit_per_s == pytest.approx(20.0, rel=0.10)
    assert bucket.stats().scheduled_rate_bits == pytest.approx(20e6, rel=0.10)


def test_rates_delays_and_bounds():
    assert parse_rate("100mbit") == 100_000_000 and parse_rate("1.5Mbit") == 1_500_000 and parse_rate("500kbit") == 500_000
    assert parse_delay("40ms") == pytest.approx(0.04) and parse_delay(None) == 0.0
    for bad in ("fast", "10MBps", "-5mbit", "0mbit"):
        with pytest.raises(ValueError, match="bad rate") as error:
            parse_rate(bad)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="bad delay"):
        parse_delay("soon")
    assert link_bound("8mbit", 1000, 500) == pytest.approx(1000.0)  # full duplex: the bigger direction
    assert link_bound("8mbit", 1000, 500, shared=True) == pytest.approx(1_000_000 / 1500)
    assert compute_bound([0.01, 0.02, 0.005]) == pytest.approx(50.0)
    assert fraction_of_bound(40.0, 100.0, 50.0) == pytest.approx(0.8)


def test_adaptive_compression_follows_a_bandwidth_drop_and_recovers_with_hysteresis():
    elements = 64 * 32 * 32  # ResNet-18 layer1, per sample
    adaptive = AdaptiveCompression({0: topk_candidates(elements)}, hysteresis=0.15)
    target = 0.008  # seconds of link time per sample the compute allows
    assert adaptive.decide(parse_rate("1gbit"), target)[0].spec in ("none", "topk:1.0")  # fast: no compression
    dropped = adaptive.decide(parse_rate("20mbit"), target)[0]
    assert dropped.changed and dropped.spec.startswith("topk:") and dropped.link_seconds <= target
    milder = [c.spec for c in adaptive.candidates[0]].index(dropped.spec) - 1
    assert milder >= 0  # a milder setting exists, and it does not fit at 20 Mbit/s
    assert adaptive.candidates[0][milder].link_seconds(parse_rate("20mbit")) > target
    assert not adaptive.decide(parse_rate("21mbit"), target)[0].changed  # a small recovery does not flap back
    assert adaptive.decide(parse_rate("1gbit"), target)[0].index == 0
    assert len(adaptive.history) == 3 and "change(s)" in adaptive.report()


def test_docker_files_are_consistent_and_the_entrypoint_shapes_in_dry_run():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"bootstrap", "trainer"} <= set(services) and sum(name.startswith("stage") for name in services) == 4
    for name, service in services.items():
        assert "NET_ADMIN" in service.get("cap_add", []), name
        assert "healthcheck" in service or name == "trainer", name
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert dockerfile.lstrip().startswith(("ARG", "FROM", "#")) and "FROM" in dockerfile and "ARG" in dockerfile
    env = dict(os.environ, DRY_RUN="1", RATE="20mbit", DELAY="50ms", ROLE="stage", STAGE="2", IFACE="eth0")
    out = subprocess.run(["sh", str(ROOT / "docker" / "entrypoint.sh")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tc qdisc" in out.stdout and "20mbit" in out.stdout and "peers.stage --stage 2" in out.stdout
    env["ROLE"], env["STAGE"] = "stage", ""
    assert subprocess.run(["sh", str(ROOT / "docker" / "entrypoint.sh")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60).returncode != 0
