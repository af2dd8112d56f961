"""docker/: the files checked as data, and the entrypoint's shaping run for real inside a network
namespace (real tc, never a mock). The whole compose swarm in a real Docker engine is
docker/smoke.sh, which .ci/run runs after the suite (it builds images: minutes, not a unit test)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml
from _util import REPO

from swarm.netlab.namespaces import NetLab, NetlabError, require

DOCKER = REPO / "docker"
PEERS = {"bootstrap", "stage0", "stage1", "stage2", "stage3", "trainer"}
WATCHERS = {"status", "prometheus"}  # not in the pipeline: the health page and Prometheus
ENTRYPOINT = DOCKER / "entrypoint.sh"
# the entrypoint's own variables are what each test sets, never what the calling shell exported
ENTRYPOINT_VARS = (
    "RATE",
    "DELAY",
    "INGRESS",
    "IFACE",
    "NETEM",
    "ROLE",
    "STAGE",
    "CONFIG",
    "RUN_ID",
    "STEPS",
    "RESULTS",
    "PORT",
    "ANNOUNCE",
    "PUBLIC_IP",
    "INITIAL_PEERS",
    "BOOTSTRAP_HOST",
    "BOOTSTRAP_PORT",
    "BOOTSTRAP_IDENTITY",
    "WAIT",
    "UPLINK",
    "DOWNLINK",
    "THREADS",
    "METRICS_PORT",
    "STATUS_PORT",
    "DRY_RUN",
)
ENV = {k: v for k, v in os.environ.items() if k not in ENTRYPOINT_VARS}
ENV["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _entrypoint(env: dict, *args: str, wrap=None) -> subprocess.CompletedProcess:
    argv = ["sh", str(ENTRYPOINT), *args]
    return subprocess.run(
        wrap(argv) if wrap else argv, capture_output=True, text=True, env={**ENV, **env}, cwd=REPO, timeout=60
    )


def test_compose_has_the_swarm_with_caps_and_health_checks():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == PEERS | WATCHERS
    for name in PEERS:
        service = services[name]
        assert "NET_ADMIN" in service.get("cap_add", []), name
        check = service["healthcheck"]
        assert (
            check["test"][0] in ("CMD", "CMD-SHELL")
            and "port-open" in " ".join(check["test"])
            and "PORT" in check["test"][-1]
        ), name
        env = service["environment"]
        assert {"RATE", "DELAY"} <= set(env), name
        assert service["build"]["dockerfile"] == "docker/Dockerfile" and service["build"]["context"] == ".."
    assert (
        services["bootstrap"]["environment"]["ROLE"] == "bootstrap" and "31337:31337" in services["bootstrap"]["ports"]
    )
    for i in range(4):
        stage = services[f"stage{i}"]
        assert stage["environment"]["ROLE"] == "stage" and stage["environment"]["STAGE"] == str(i)
        assert stage["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert set(services["trainer"]["depends_on"]) == {f"stage{i}" for i in range(4)}
    assert "shared" in compose["volumes"]
    # the health page: the hivepipe image, ROLE=status, checked on its own port (not the p2p PORT)
    status = services["status"]
    assert status["environment"]["ROLE"] == "status" and status["environment"]["STATUS_PORT"] == "8080"
    assert "8080:8080" in status["ports"] and "swarm" in status["networks"]
    assert status["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    check = status["healthcheck"]["test"]
    assert "port-open" in check[-1] and "STATUS_PORT:-8080" in check[-1] and "$${PORT" not in check[-1]
    assert "NET_ADMIN" not in status.get("cap_add", [])  # an observer: its link is not shaped
    assert not status["environment"]["RATE"] and not status["environment"]["DELAY"]
    # Prometheus: not a peer, so nothing of the x-peer anchor (no build, caps, peer health check)
    prometheus = services["prometheus"]
    # a pinned version, unless PROMETHEUS_IMAGE names another (docker/smoke.sh: Debian's package)
    assert re.fullmatch(r"\$\{PROMETHEUS_IMAGE:-prom/prometheus:v\d+\.\d+\.\d+\}", prometheus["image"])
    assert not {"build", "cap_add", "healthcheck", "environment", "init"} & set(prometheus)
    assert "9090:9090" in prometheus["ports"] and prometheus["networks"] == ["swarm"]
    mounts = {v.split(":")[1]: v.split(":") for v in prometheus["volumes"]}
    source, _, mode = mounts["/etc/prometheus/prometheus.yml"]
    assert mode == "ro" and (DOCKER / source).resolve() == (DOCKER / "prometheus.yml").resolve()
    assert (DOCKER / source).is_file()


def test_prometheus_scrapes_every_peer_at_its_metrics_port():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    port = compose["x-env"]["METRICS_PORT"]
    assert port == "9100" and all(compose["services"][name]["environment"]["METRICS_PORT"] == port for name in PEERS)
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "hivepipe"]
    assert job.get("scrape_interval", config.get("global", {}).get("scrape_interval")) == "5s"
    targets = [t for static in job["static_configs"] for t in static["targets"]]
    assert sorted(targets) == sorted(f"{name}:{port}" for name in PEERS)  # each once, no watcher
    # the `peer` label: the host name of the address, unless a static_config gives one
    (relabel,) = job["relabel_configs"]
    assert relabel["source_labels"] == ["peer", "__address__"] and relabel["target_label"] == "peer"
    for target in targets:
        joined = ";".join(["", target])  # what Prometheus matches: the source labels joined by ";"
        match = re.fullmatch(relabel["regex"], joined)
        assert match and relabel["replacement"].replace("$1", match.group(1)) == target.split(":")[0]
    assert not re.fullmatch(relabel["regex"], "stage2-remote;203.0.113.9:9100")  # a label given is kept


@pytest.mark.peers
def test_public_override_gives_every_peer_a_published_port_and_its_public_address():
    base = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    public = yaml.safe_load((DOCKER / "compose.public.yaml").read_text())["services"]
    # the trainer is a DHT client: nobody dials it. Neither is in the swarm what watches it: the health
    # page (status) only dials out, and Prometheus scrapes the peers on the Docker network
    assert set(public) == set(base) - {"trainer"} - WATCHERS
    ports = {name: service["environment"]["PORT"] for name, service in public.items()}
    assert (
        len(set(ports.values())) == len(ports)
        and ports["bootstrap"] == base["bootstrap"]["environment"]["BOOTSTRAP_PORT"]
    )
    for name, service in public.items():
        # compose refuses to start without it
        assert service["environment"]["PUBLIC_IP"].startswith("${PUBLIC_IP:?"), name
        published = service.get("ports", []) + base[name].get("ports", [])
        assert published == [f"{ports[name]}:{ports[name]}"], name  # once: a port published twice would clash
    out = _entrypoint(
        {
            "DRY_RUN": "1",
            "PUBLIC_IP": "203.0.113.7",
            "PORT": "31340",
            "ROLE": "stage",
            "STAGE": "2",
            "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm",
        }
    )
    assert (
        "--host_maddrs /ip4/0.0.0.0/tcp/31340 --announce_maddrs /ip4/203.0.113.7/tcp/31340 /ip4/CONTAINER_IP/tcp/31340"
        in out.stdout
    ), out.stdout + out.stderr
    given = _entrypoint(
        {
            "DRY_RUN": "1",
            "PUBLIC_IP": "203.0.113.7",
            "ANNOUNCE": "/ip4/5.6.7.8/tcp/1 /ip4/9.9.9.9/tcp/1",
            "ROLE": "bootstrap",
        }
    )
    # the dry run quotes each argument: two addresses, not one with a space in it
    assert given.stdout.rstrip().endswith("--announce_maddrs /ip4/5.6.7.8/tcp/1 /ip4/9.9.9.9/tcp/1"), (
        given.stdout + given.stderr
    )
    named = _entrypoint({"DRY_RUN": "1", "PUBLIC_IP": "swarm.example.org", "ROLE": "bootstrap"})
    assert (
        named.returncode == 2
        and named.stderr.strip()
        == "error: PUBLIC_IP must be an IPv4 address, got 'swarm.example.org' (for a name or IPv6, set ANNOUNCE)"
    )


def test_dockerfile_lint():
    text = (DOCKER / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0].startswith(("ARG", "FROM")) and any(line.startswith("FROM") for line in lines)
    declared = {m.group(1) for m in re.finditer(r"^ARG\s+(\w+)", text, re.M)}
    used = set(re.findall(r"\$\{(\w+)", text)) | set(re.findall(r"\$(\w+)", text))
    assert {"BASE_IMAGE", "TORCH_VARIANT", "TORCH_INDEX"} <= declared
    pip_settings = {arg for arg in declared if arg.startswith("PIP_")}  # pip reads them from RUN's environment
    assert declared - pip_settings <= used, f"ARGs never used: {declared - pip_settings - used}"
    assert "FROM ${BASE_IMAGE}" in text and "iproute2" in text and "HEALTHCHECK" in text
    assert 'ENTRYPOINT ["hivepipe-entrypoint"]' in text and "docker/entrypoint.sh" in text
    for path in re.findall(r"^COPY\s+(\S+)", text, re.M):
        assert (REPO / path).exists(), f"COPY {path}: missing from the build context"


@pytest.mark.peers
def test_entrypoint_dry_run_prints_tc_and_the_peer_command():
    out = _entrypoint(
        {"DRY_RUN": "1", "RATE": "20mbit", "DELAY": "50ms", "ROLE": "stage", "STAGE": "2", "IFACE": "eth0"},
        "--set",
        "train.epochs=2",
    )
    assert out.returncode == 0, out.stderr
    assert "tc qdisc replace dev eth0 root netem delay 50ms rate 20000000bit" in out.stdout
    assert "tbf rate 20000000bit" in out.stdout  # the fallback when the kernel has no netem
    assert (
        "peers.stage --stage 2 --config configs/smoke.yaml --run_id docker" in out.stdout
        and "--set train.epochs=2" in out.stdout
    )
    assert "--uplink 20mbit" in out.stdout and "--downlink" not in out.stdout  # what it receives is not shaped here
    both = _entrypoint(
        {
            "DRY_RUN": "1",
            "RATE": "20mbit",
            "INGRESS": "1",
            "ROLE": "stage",
            "STAGE": "0",
            "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm",
        }
    )
    assert "--uplink 20mbit --downlink 20mbit" in both.stdout, both.stderr
    declared = _entrypoint(
        {
            "DRY_RUN": "1",
            "UPLINK": "30mbit",
            "DOWNLINK": "200mbit",
            "ROLE": "stage",
            "STAGE": "0",
            "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm",
        }
    )
    assert "--uplink 30mbit --downlink 200mbit" in declared.stdout and "tc " not in declared.stdout
    assert "--threads" not in declared.stdout  # torch's default unless asked
    for role in ("stage", "trainer"):
        shared = _entrypoint(
            {"DRY_RUN": "1", "THREADS": "1", "ROLE": role, "STAGE": "0", "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm"}
        )
        assert shared.stdout.rstrip().endswith("--threads 1"), shared.stdout + shared.stderr
    trainer = _entrypoint(
        {"DRY_RUN": "1", "ROLE": "trainer", "STEPS": "5", "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm"}
    )
    assert (
        "peers.trainer" in trainer.stdout
        and "--initial_peers /ip4/1.2.3.4/tcp/1/p2p/Qm" in trainer.stdout
        and "--steps 5" in trainer.stdout
    )
    # no RATE, no DELAY: no shaping, nothing declared
    assert "tc " not in trainer.stdout and "--uplink" not in trainer.stdout
    for role in ("bootstrap", "stage", "trainer"):  # a delay without netem: the peer adds it in process
        delayed = _entrypoint(
            {
                "DRY_RUN": "1",
                "NETEM": "no",
                "DELAY": "25ms",
                "ROLE": role,
                "STAGE": "1",
                "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm",
            }
        )
        assert (
            "delay 25ms NOT applied" in delayed.stdout
            and "the peer adds it" in delayed.stdout
            and delayed.stdout.rstrip().endswith("--shape_delay 25ms")
        ), delayed.stdout + delayed.stderr
    assert "--shape_delay" not in out.stdout  # a dry run assumes netem takes the delay (it is tried first)
    paced = _entrypoint(
        {"DRY_RUN": "1", "ROLE": "trainer", "RATE": "20mbit", "INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1/p2p/Qm"}
    )
    assert "peers.trainer" in paced.stdout and "--uplink 20mbit" in paced.stdout, paced.stdout + paced.stderr


@pytest.mark.peers
def test_entrypoint_metrics_port_and_the_status_page():
    peers = "/ip4/1.2.3.4/tcp/1/p2p/Qm"
    for role in ("bootstrap", "stage", "trainer"):
        env = {"DRY_RUN": "1", "ROLE": role, "STAGE": "0", "INITIAL_PEERS": peers}
        out = _entrypoint({**env, "METRICS_PORT": "9100"}, "--set", "train.epochs=2")
        assert out.returncode == 0, out.stderr
        assert f"+ exec python -m peers.{role} " in out.stdout, out.stdout
        # before the arguments given, which come last
        # the trainer's metrics outlive its run (a short run ends between two scrapes)
        linger = " --metrics_linger 15" if role == "trainer" else ""
        metrics = f"--metrics_port 9100 --metrics_host 0.0.0.0{linger} --set train.epochs=2"
        assert out.stdout.rstrip().endswith(metrics), out.stdout + out.stderr
        plain = _entrypoint(env)
        assert plain.returncode == 0 and "--metrics_port" not in plain.stdout, plain.stdout + plain.stderr
    status = _entrypoint({"DRY_RUN": "1", "ROLE": "status", "METRICS_PORT": "9100", "INITIAL_PEERS": peers})
    assert status.returncode == 0, status.stderr
    assert (
        status.stdout.strip()
        == f"+ exec python -m peers.status --initial_peers {peers} --serve 8080 --serve_host 0.0.0.0 --run_id docker"
    ), status.stdout
    derived = _entrypoint({"DRY_RUN": "1", "ROLE": "status", "STATUS_PORT": "8081", "RUN_ID": "demo"})
    assert (
        "peers.status --initial_peers /ip4/bootstrap_IP/tcp/31337/p2p/ID_FROM_/shared/bootstrap.id "
        "--serve 8081 --serve_host 0.0.0.0 --run_id demo" in derived.stdout
    ), derived.stdout + derived.stderr


@pytest.mark.peers
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RATE": "fast"}, "bad rate"),
        ({"RATE": "10mbps"}, "ambiguous"),
        ({"ROLE": "stage", "STAGE": ""}, "needs STAGE"),
        ({"ROLE": "bogus"}, "ROLE must be bootstrap, stage, trainer, status or empty, got 'bogus'"),
    ],
)
def test_entrypoint_bad_input_is_one_line(env, message):
    out = _entrypoint({"DRY_RUN": "1", **env}, "true")
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.peers
def test_entrypoint_shapes_for_real_inside_a_namespace():
    try:
        require()
    except NetlabError as e:
        pytest.fail(f"this test needs Linux namespaces with tc (root, iproute2): {e}")
    with NetLab(["peer"]) as net:
        out = _entrypoint(
            {"RATE": "20mbit", "DELAY": "5ms", "INGRESS": "1"},
            "tc",
            "qdisc",
            "show",
            wrap=lambda argv: net.wrap("peer", argv),
        )
        assert out.returncode == 0, out.stderr
        assert re.search(r"qdisc (tbf|netem) \S+ dev eth0 root .*rate 20Mbit", out.stdout), out.stdout
        assert "dev ifb0 root" in out.stdout and "ingress ffff: dev eth0" in out.stdout
        assert "shaped eth0" in out.stdout
        if "netem" not in out.stdout.split("shaped eth0")[1]:
            assert "NOT applied" in out.stdout  # no netem here: said, not silently dropped
            # what tc left, read back
            assert "delay 5ms not applied: no netem, and no peer to add it (ROLE is empty)" in out.stdout
