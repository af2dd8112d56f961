#!/bin/sh
# hivepipe container entrypoint: shape this container's link, then run its peer.
#
# Link shaping (needs cap_add NET_ADMIN; uses python -m swarm.netlab shape, the same tc commands
# as the namespace lab):
#   RATE=20mbit      egress rate of IFACE (tbf; with DELAY and a kernel with netem: netem rate+delay)
#   DELAY=50ms       one-way delay (netem; without netem the peer adds it to what it sends, in process)
#   INGRESS=1        also shape what the container receives (ifb; needs ifb/u32/mirred on the host)
#   IFACE=eth0
#   NETEM=auto       auto: netem when DELAY is set and the kernel has it; yes: fail without it; no: never
# The peer:
#   ROLE=bootstrap | stage | trainer | status   (empty: run the given command after shaping)
#   STAGE=N (stage), CONFIG=configs/smoke.yaml, RUN_ID=docker, STEPS, RESULTS (trainer)
#   PORT=31337                 every peer listens on /ip4/0.0.0.0/tcp/$PORT
#   ANNOUNCE=/ip4/PUBLIC/tcp/31337   --announce_maddrs, for peers outside this Docker network
#                              (several: separated by spaces)
#   PUBLIC_IP=203.0.113.7      without ANNOUNCE: announce /ip4/PUBLIC_IP/tcp/$PORT (other machines)
#                              and this container's own address (peers on this Docker network)
#   INITIAL_PEERS=/ip4/.../p2p/ID    join this peer; otherwise the bootstrap's address is derived
#   BOOTSTRAP_HOST=bootstrap BOOTSTRAP_PORT=31337 BOOTSTRAP_IDENTITY=/shared/bootstrap.id
#                              from its key file on the shared volume and its host name
#   WAIT=180                   seconds to wait for the bootstrap's key file
# Arguments are appended to the peer's command line (e.g. --set train.epochs=2).
#   UPLINK=, DOWNLINK=         a peer's link rates (--uplink/--downlink: it paces each neighbour
#                              flow at its share); default: RATE, and for DOWNLINK only with INGRESS=1
#   THREADS=N                  torch CPU threads of a stage peer or trainer (--threads); set it when
#                              several containers share one host's cores (compose on one machine)
#   METRICS_PORT=9100          a peer's Prometheus metrics at http://0.0.0.0:$METRICS_PORT/metrics
#                              (--metrics_port, on every interface; bootstrap, stage, trainer)
#   METRICS_LINGER=15          the trainer's metrics stay up this many seconds after its run ends, so a
#                              Prometheus scraping every 5 s sees a short run's last step (--metrics_linger)
#   STATUS_PORT=8080           ROLE=status: the swarm's health page (python -m peers.status --serve) at
#                              http://0.0.0.0:$STATUS_PORT/, a DHT client that only dials out
#                              (RUN_ID: only that run)
#   DRY_RUN=1                  print the tc commands and the peer command (quoted); run nothing
set -eu

PORT="${PORT:-31337}"
IFACE="${IFACE:-eth0}"
BOOTSTRAP_HOST="${BOOTSTRAP_HOST:-bootstrap}"
BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-31337}"
BOOTSTRAP_IDENTITY="${BOOTSTRAP_IDENTITY:-/shared/bootstrap.id}"
CONFIG="${CONFIG:-configs/smoke.yaml}"
RUN_ID="${RUN_ID:-docker}"
DRY=""
if [ -n "${DRY_RUN:-}" ] && [ "${DRY_RUN}" != "0" ]; then DRY=1; fi

fail() { echo "error: $*" >&2; exit 2; }

# 1. this container's link; a delay tc cannot apply (no netem) is left to the peer (--shape_delay)
delay_left=""
if [ -n "${RATE:-}${DELAY:-}" ]; then
    ingress=""
    if [ "${INGRESS:-0}" = "1" ]; then ingress="--ingress"; fi
    left_file=$(mktemp)
    python -m swarm.netlab shape --dev "$IFACE" ${RATE:+--rate "$RATE"} ${DELAY:+--delay "$DELAY"} --netem "${NETEM:-auto}" \
        $ingress ${DRY:+--dry-run} --delay-left "$left_file" || { status=$?; rm -f "$left_file"; exit $status; }
    delay_left=$(cat "$left_file")
    rm -f "$left_file"
fi
shape_delay=""
if [ -n "$delay_left" ] && [ -n "${ROLE:-}" ]; then
    shape_delay="$delay_left"
    echo "delay $delay_left: the peer adds it to every message it sends (in process)"
elif [ -n "$delay_left" ]; then
    echo "delay $delay_left not applied: no netem, and no peer to add it (ROLE is empty)"
fi

# 2. its peer
if [ -z "${ANNOUNCE:-}" ] && [ -n "${PUBLIC_IP:-}" ]; then
    python -c 'import ipaddress, sys; ipaddress.IPv4Address(sys.argv[1])' "$PUBLIC_IP" 2>/dev/null \
        || fail "PUBLIC_IP must be an IPv4 address, got '$PUBLIC_IP' (for a name or IPv6, set ANNOUNCE)"
    ANNOUNCE="/ip4/$PUBLIC_IP/tcp/$PORT"
    if [ -z "$DRY" ]; then
        own=$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))') || fail "cannot resolve this container's address"
        ANNOUNCE="$ANNOUNCE /ip4/$own/tcp/$PORT"
    else
        ANNOUNCE="$ANNOUNCE /ip4/CONTAINER_IP/tcp/$PORT"
    fi
fi
initial_peers() {
    if [ -n "${INITIAL_PEERS:-}" ]; then
        echo "$INITIAL_PEERS"
    elif [ -n "$DRY" ]; then
        echo "/ip4/${BOOTSTRAP_HOST}_IP/tcp/${BOOTSTRAP_PORT}/p2p/ID_FROM_${BOOTSTRAP_IDENTITY}"
    else
        python -m swarm.netlab bootstrap-maddr --identity "$BOOTSTRAP_IDENTITY" --host "$BOOTSTRAP_HOST" --port "$BOOTSTRAP_PORT" --wait "${WAIT:-180}"
    fi
}

case "${ROLE:-}" in
    bootstrap)
        if [ -z "$DRY" ]; then python -m swarm.netlab identity "$BOOTSTRAP_IDENTITY" >/dev/null; fi
        set -- python -m peers.bootstrap --identity_path "$BOOTSTRAP_IDENTITY" \
            --host_maddrs "/ip4/0.0.0.0/tcp/$PORT" ${ANNOUNCE:+--announce_maddrs $ANNOUNCE} ${shape_delay:+--shape_delay "$shape_delay"} \
            ${METRICS_PORT:+--metrics_port "$METRICS_PORT" --metrics_host 0.0.0.0} "$@"
        ;;
    stage)
        [ -n "${STAGE:-}" ] || fail "ROLE=stage needs STAGE (0-based stage index)"
        peers=$(initial_peers) || exit 1
        uplink="${UPLINK:-${RATE:-}}"
        downlink="${DOWNLINK:-}"
        if [ -z "$downlink" ] && [ "${INGRESS:-0}" = "1" ]; then downlink="${RATE:-}"; fi
        set -- python -m peers.stage --stage "$STAGE" --config "$CONFIG" --run_id "$RUN_ID" --initial_peers "$peers" \
            --host_maddrs "/ip4/0.0.0.0/tcp/$PORT" ${ANNOUNCE:+--announce_maddrs $ANNOUNCE} \
            ${uplink:+--uplink "$uplink"} ${downlink:+--downlink "$downlink"} ${THREADS:+--threads "$THREADS"} ${shape_delay:+--shape_delay "$shape_delay"} \
            ${METRICS_PORT:+--metrics_port "$METRICS_PORT" --metrics_host 0.0.0.0} "$@"
        ;;
    trainer)
        peers=$(initial_peers) || exit 1
        uplink="${UPLINK:-${RATE:-}}"  # it paces the inputs it sends stage 0
        set -- python -m peers.trainer --config "$CONFIG" --run_id "$RUN_ID" --initial_peers "$peers" \
            --host_maddrs "/ip4/0.0.0.0/tcp/$PORT" ${ANNOUNCE:+--announce_maddrs $ANNOUNCE} ${uplink:+--uplink "$uplink"} \
            ${STEPS:+--steps "$STEPS"} ${RESULTS:+--results "$RESULTS"} ${THREADS:+--threads "$THREADS"} ${shape_delay:+--shape_delay "$shape_delay"} \
            ${METRICS_PORT:+--metrics_port "$METRICS_PORT" --metrics_host 0.0.0.0 --metrics_linger "${METRICS_LINGER:-15}"} "$@"
        ;;
    status)  # a DHT client: it listens on its default address and only dials out
        peers=$(initial_peers) || exit 1
        set -- python -m peers.status --initial_peers "$peers" --serve "${STATUS_PORT:-8080}" --serve_host 0.0.0.0 \
            ${RUN_ID:+--run_id "$RUN_ID"} ${shape_delay:+--shape_delay "$shape_delay"} "$@"
        ;;
    "")
        [ "$#" -gt 0 ] || fail "no ROLE (bootstrap, stage, trainer, status) and no command to run"
        ;;
    *)
        fail "ROLE must be bootstrap, stage, trainer, status or empty, got '$ROLE'"
        ;;
esac

if [ -n "$DRY" ]; then  # quoted as a shell would need it: one argument per word shown
    python -c 'import shlex, sys; print("+ exec", shlex.join(sys.argv[1:]))' "$@"
    exit 0
fi
exec "$@"
