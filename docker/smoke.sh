#!/usr/bin/env bash
# The compose swarm for real: builds the peer image, starts docker/compose.yaml (bootstrap, four
# stages, trainer, health page, Prometheus) with shaped links, waits for the trainer's short run,
# and checks it: every peer's health check, the health page, Prometheus's scrapes, and the
# trainer's losses against one process (python -m swarm run, same config, same threads). Then it
# takes everything down.
#
#   bash docker/smoke.sh            # STEPS=6 RATE=20mbit DELAY=10ms by default
#
# As root on a Debian machine it installs what it lacks (docker.io, docker-compose, debootstrap)
# and starts dockerd. Where no image registry answers, the base image is built from Debian's
# packages (debootstrap, docker import) and Prometheus from Debian's package; where this machine
# has local package indexes (/opt/pypi*/simple), the build's pip is served them over the docker
# bridge. Where it cannot run at all, it says why in one line and exits 2.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS="${STEPS:-6}"
PROJECT=hivepipe-smoke
BASE_TAG=hivepipe-base:bookworm
PROM_TAG=hivepipe-prometheus:debian
WORK=$(mktemp -d /var/tmp/hivepipe-smoke.XXXXXX)
say() { echo "[smoke] $*"; }
cannot() { echo "docker smoke: cannot run here: $*" >&2; exit 2; }
fail() { echo "docker smoke: FAILED: $*" >&2; exit 1; }

# ---- 1. docker, compose and debootstrap; the daemon ---------------------------------------------
need=""
for tool in docker:docker.io docker-compose:docker-compose debootstrap:debootstrap curl:curl; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need="$need ${tool#*:}"
done
if [ -n "$need" ]; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || cannot "missing$need, and no root apt-get to install them"
    say "installing$need"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null \
        || cannot "apt-get could not install$need"
fi
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null && [ "$(id -u)" = 0 ] || cannot "no Docker daemon answers, and none can be started here"
    say "starting dockerd"
    nohup dockerd >/var/log/hivepipe-dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || cannot "dockerd did not start: $(tail -n 1 /var/log/hivepipe-dockerd.log)"
fi

server=""
cleanup() {
    if [ -z "${KEEP:-}" ]; then
        for project in "$PROJECT" "$PROJECT-remote"; do
            docker-compose -p "$project" -f docker/compose.yaml down -v --remove-orphans >/dev/null 2>&1 || true
        done
    fi
    [ -n "$server" ] && kill "$server" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# ---- 2. the base image: Debian's Python in a venv (python and pip on PATH) -------------------------
if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    say "building $BASE_TAG from Debian's packages (debootstrap)"
    debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates,procps \
        bookworm "$WORK/root" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
        || fail "debootstrap: $(tail -n 1 "$WORK/debootstrap.log")"
    chroot "$WORK/root" python3 -m venv /opt/venv
    # it trusts the certificates this machine trusts (a network whose proxy signs with its own CA)
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/root/etc/ssl/certs/ca-certificates.crt"
    tar -C "$WORK/root" -c . | docker import \
        -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        - "$BASE_TAG" >/dev/null
    rm -rf "$WORK/root"
fi

# ---- 3. the images: the build's pip gets this machine's local indexes, if it has them --------------
args=(--build-arg "BASE_IMAGE=$BASE_TAG")
gateway=$(ip -4 -o addr show docker0 | awk '{split($4, a, "/"); print a[1]; exit}')  # the host, seen from a build
[ -n "$gateway" ] || cannot "the docker0 bridge has no IPv4 address"
indexes=""
for dir in /opt/pypi /opt/pypi-more; do
    [ -d "$dir/simple" ] && indexes="$indexes http://$gateway:8765/$(basename "$dir")/simple"
done
if [ -n "$indexes" ]; then
    python3 -m http.server 8765 --bind "$gateway" --directory /opt >/dev/null 2>&1 &
    server=$!
    torch_index=$(for i in $indexes; do echo "$i"; done | tail -n 1)
    args+=(--build-arg "PIP_EXTRA_INDEX_URL=$indexes https://pypi.org/simple" --build-arg "PIP_TRUSTED_HOST=$gateway"
        --build-arg "TORCH_INDEX=$torch_index")
    say "the build's pip reads this machine's indexes:$indexes"
fi
say "building hivepipe:cpu"
docker build -q -f docker/Dockerfile -t hivepipe:cpu "${args[@]}" . >"$WORK/build.log" 2>&1 \
    || fail "docker build: $(tail -n 5 "$WORK/build.log")"
docker build -q -f docker/prometheus.Dockerfile -t "$PROM_TAG" --build-arg "BASE_IMAGE=$BASE_TAG" docker \
    >"$WORK/prom.log" 2>&1 || fail "prometheus image: $(tail -n 5 "$WORK/prom.log")"

# ---- 4. the swarm ----------------------------------------------------------------------------------
export STEPS RATE="${RATE:-20mbit}" DELAY="${DELAY:-10ms}" THREADS=1 RUN_ID=smoke CONFIG=configs/smoke.yaml
export PROMETHEUS_IMAGE="$PROM_TAG"
rm -rf docker/results
say "compose up: RATE=$RATE DELAY=$DELAY STEPS=$STEPS"
docker-compose -p "$PROJECT" -f docker/compose.yaml up -d >"$WORK/up.log" 2>&1 || fail "compose up: $(tail -n 5 "$WORK/up.log")"
trainer=$(docker-compose -p "$PROJECT" -f docker/compose.yaml ps -q trainer)
code=$(timeout 900 docker wait "$trainer") || fail "the trainer did not finish within 900 s"
docker logs "$trainer" 2>&1 | tail -n 4 | sed 's/^/[trainer] /'
[ "$code" = 0 ] || fail "the trainer exited with $code: $(docker logs "$trainer" 2>&1 | tail -n 3)"

# ---- 5. the checks ----------------------------------------------------------------------------------
for service in bootstrap stage0 stage1 stage2 stage3 status; do
    id=$(docker-compose -p "$PROJECT" -f docker/compose.yaml ps -q "$service")
    health=$(docker inspect -f '{{.State.Health.Status}}' "$id")
    [ "$health" = healthy ] || fail "$service is $health"
done
say "health checks: bootstrap, stage0..3 and status healthy"
stage1=$(docker-compose -p "$PROJECT" -f docker/compose.yaml ps -q stage1)
qdisc=$(docker exec "$stage1" tc qdisc show dev eth0)
case "$qdisc" in *"rate ${RATE%mbit}Mbit"*) ;; *) fail "stage1's eth0 is not shaped to $RATE: $qdisc" ;; esac
logs=$(docker logs "$stage1" 2>&1)  # whole, not piped to grep -q (pipefail: a writer cut short fails)
case "$logs" in *"delay $DELAY: the peer adds it"* | *"netem delay $DELAY"*) ;; *) fail "stage1's delay $DELAY went nowhere" ;; esac
say "stage1's link: $(echo "$qdisc" | head -n 1)"
page=$(curl -sf http://127.0.0.1:8080/) || fail "no health page at :8080"
case "$page" in *"<html"*) ;; *) fail "the health page at :8080 is not a page" ;; esac
for _ in $(seq 30); do  # it reads the swarm every few seconds
    curl -sf http://127.0.0.1:8080/data.json >"$WORK/data.json" && python3 - "$WORK/data.json" <<'EOF' && break
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
peers = [p for run in runs for stage in run.get("stages", []) for p in stage.get("peers", [])]
sys.exit(0 if len(peers) >= 4 and all(p.get("reachable") for p in peers) else 1)
EOF
    sleep 2
done
python3 - "$WORK/data.json" <<'EOF' || fail "the health page does not show four reachable stage peers"
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
peers = [p for run in runs for stage in run.get("stages", []) for p in stage.get("peers", [])]
print(f"[smoke] health page: {len(peers)} stage peers, all reachable: {all(p.get('reachable') for p in peers)}")
sys.exit(0 if len(peers) >= 4 and all(p.get("reachable") for p in peers) else 1)
EOF
query() { curl -sf -G --data-urlencode "query=$1" http://127.0.0.1:9090/api/v1/query; }
query 'max_over_time(hivepipe_trainer_loss[15m])' >"$WORK/loss.json" || fail "Prometheus does not answer at :9090"
query up >"$WORK/up.json" || fail "Prometheus does not answer at :9090"
python3 - "$WORK/loss.json" "$WORK/up.json" <<'EOF' || fail "Prometheus did not scrape the peers"
import json, sys
loss = json.load(open(sys.argv[1]))["data"]["result"]
up = {r["metric"].get("peer"): r["value"][1] for r in json.load(open(sys.argv[2]))["data"]["result"]}
print(f"[smoke] Prometheus: trainer loss scraped: {bool(loss)}; targets up: {sorted(p for p, v in up.items() if v == '1')}")
sys.exit(0 if loss and all(up.get(p) == "1" for p in ("bootstrap", "stage0", "stage1", "stage2", "stage3")) else 1)
EOF
cat >"$WORK/same_losses.py" <<'EOF'
"""The trainer's per-step losses (docker/results/docker.jsonl) against one process on the same
config (python -m swarm run, one thread as the peers), within 1e-5."""
import json, os, subprocess, sys, tempfile
steps = int(sys.argv[1])
env = dict(os.environ, OMP_NUM_THREADS="1")  # the peers' --threads 1
rows = [json.loads(line) for line in open("docker/results/docker.jsonl")]
ours = [r["loss"] for r in rows if r.get("type") == "step"]
with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
    subprocess.run([sys.executable, "-m", "swarm", "run", "configs/smoke.yaml", "--set", "model.num_stages=4",
                    "--steps", str(steps), "--results", f.name], check=True, capture_output=True, env=env)
    theirs = [json.loads(line)["loss"] for line in open(f.name) if json.loads(line).get("type") == "step"]
print(f"[smoke] losses: swarm {ours}")
print(f"[smoke]         one process {theirs}")
sys.exit(0 if len(ours) == len(theirs) == steps and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs)) else 1)
EOF
python3 "$WORK/same_losses.py" "$STEPS" || fail "the swarm's losses are not one process's"
docker-compose -p "$PROJECT" -f docker/compose.yaml down -v >/dev/null 2>&1

# ---- 6. another machine: stage 2 from a second compose project, through published ports -----------
# (compose.public.yaml: each peer its own published port, the host's address announced)
host_ip=$(ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") {print $(i + 1); exit}}')
[ -n "$host_ip" ] || host_ip="$gateway"
export PUBLIC_IP="$host_ip" STEPS=4 RUN_ID=split RATE="" DELAY=""
public=(-f docker/compose.yaml -f docker/compose.public.yaml)
rm -rf docker/results
say "another machine: stage 2 in project $PROJECT-remote, the rest in $PROJECT, via $host_ip"
docker-compose -p "$PROJECT" "${public[@]}" up -d bootstrap stage0 stage1 stage3 >"$WORK/a.log" 2>&1 \
    || fail "compose up (this host): $(tail -n 3 "$WORK/a.log")"
boot=$(docker-compose -p "$PROJECT" -f docker/compose.yaml exec -T bootstrap python -m swarm.netlab identity /shared/bootstrap.id | tail -n 1)
INITIAL_PEERS="/ip4/$host_ip/tcp/31337/p2p/$boot" docker-compose -p "$PROJECT-remote" "${public[@]}" \
    up -d --no-deps stage2 >"$WORK/b.log" 2>&1 || fail "compose up (the other machine): $(tail -n 3 "$WORK/b.log")"
docker-compose -p "$PROJECT" "${public[@]}" up -d --no-deps trainer >"$WORK/t.log" 2>&1 \
    || fail "the trainer: $(tail -n 3 "$WORK/t.log")"
trainer=$(docker-compose -p "$PROJECT" -f docker/compose.yaml ps -q trainer)
code=$(timeout 600 docker wait "$trainer") || fail "the split swarm's trainer did not finish within 600 s"
[ "$code" = 0 ] || fail "the split swarm's trainer exited with $code: $(docker logs "$trainer" 2>&1 | tail -n 3)"
remote=$(docker-compose -p "$PROJECT-remote" -f docker/compose.yaml ps -q stage2)
# its peer drains on the first SIGTERM (waiting for another peer of its stage); the second leaves now
docker kill -s TERM "$remote" >/dev/null
sleep 3
docker kill -s TERM "$remote" >/dev/null 2>&1 || true
timeout 60 docker wait "$remote" >/dev/null || fail "the other machine's stage 2 did not stop"
logs=$(docker logs "$remote" 2>&1)
while IFS= read -r line; do
    case "$line" in *"reachable at"* | *"behind NAT"* | *"stage 2 reach:"*) echo "[remote stage2] $line" ;; esac
done <<<"$logs"
case "$logs" in *"reachable at /ip4/"*) ;; *) fail "the other machine's stage 2 was not found reachable at its published port" ;; esac
case "$logs" in *"stage 2 reach: public; streams in: "*direct*) ;; *) fail "the other machine's stage 2 took no stream: $(tail -n 5 <<<"$logs")" ;; esac
python3 "$WORK/same_losses.py" "$STEPS" || fail "the split swarm's losses are not one process's"
say "passed"
