#!/usr/bin/env bash
# infra/local/ray-up.sh        start a Ray head on 127.0.0.1 with token authentication
# infra/local/ray-down.sh      stop it (by the process group recorded in the pid file)
#
# For trying `ray job submit` on one machine:
#   infra/local/ray-up.sh && source "${BUCKETEER_LOCAL_DIR:-/tmp/bucketeer-local}/ray.env"
#   ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline.scan ...
#
# Token authentication as Ray (>= 2.52) ships it: RAY_AUTH_MODE=token on the head and on every
# client, and the token in a file named by RAY_AUTH_TOKEN_PATH. The token lives in this head's
# state folder (mode 600), not in ~/.ray/auth_token, so other local Ray instances are unaffected.
# Ray's own files (sockets, logs, ray_current_cluster) go to the state folder too, so a plain
# `ray.init()` elsewhere on this machine does not attach to this head.
# Loopback only: on Linux `ray start` replaces --node-ip-address 127.0.0.1 by the machine's routable
# address and listens on all interfaces. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 selects Ray's
# single-machine mode (the macOS/Windows default) in which the node address is 127.0.0.1 and Ray's
# ports listen on loopback; clients need it too (ray.env sets it), and no other node can join.
#
# Environment (all optional): BUCKETEER_LOCAL_DIR (state folder, keep it short: Ray puts unix
# sockets in it), RAY_PORT (GCS, 6379), RAY_DASHBOARD_PORT (job API, 8265), RAY_NUM_CPUS,
# RAY_START_TIMEOUT (seconds, 120), RAY_START_EXTRA_ARGS (more `ray start` options, e.g. ports).
set -euo pipefail

DIR="${BUCKETEER_LOCAL_DIR:-/tmp/bucketeer-local}"
PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8265}"
TIMEOUT="${RAY_START_TIMEOUT:-120}"
PID_FILE="$DIR/ray.pid"
TOKEN_FILE="$DIR/ray_auth_token"

mkdir -p "$DIR"
chmod 700 "$DIR"
if [[ -f "$PID_FILE" ]] && kill -0 -- "-$(cat "$PID_FILE")" 2>/dev/null; then
    echo "ray-up: a head started from $DIR is already running (pid $(cat "$PID_FILE")); stop it with infra/local/ray-down.sh" >&2
    exit 1
fi
command -v ray >/dev/null || { echo "ray-up: no 'ray' on PATH; activate the environment where bucketeer is installed" >&2; exit 1; }

if [[ ! -s "$TOKEN_FILE" ]]; then
    (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$TOKEN_FILE")
fi
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
export RAY_USAGE_STATS_ENABLED=0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0

extra=()
[[ -n "${RAY_NUM_CPUS:-}" ]] && extra+=(--num-cpus "$RAY_NUM_CPUS")
# shellcheck disable=SC2206  # word splitting of the extra options is intended
[[ -n "${RAY_START_EXTRA_ARGS:-}" ]] && extra+=($RAY_START_EXTRA_ARGS)

# setsid: `ray start --block` leads its own process group, which ray-down.sh kills as a whole
setsid ray start --head --block \
    --node-ip-address 127.0.0.1 --port "$PORT" \
    --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" --include-dashboard true \
    --temp-dir "$DIR/ray" --disable-usage-stats "${extra[@]}" \
    >"$DIR/ray.log" 2>&1 </dev/null &
echo $! >"$PID_FILE"

cat >"$DIR/ray.env" <<ENV
# source this file to reach the local Ray head started by infra/local/ray-up.sh
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_ADDRESS=127.0.0.1:$PORT
export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT
ENV

# ready when the job API answers an authenticated request
deadline=$((SECONDS + TIMEOUT))
until RAY_API_SERVER_ADDRESS="http://127.0.0.1:$DASHBOARD_PORT" ray job list >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$PID_FILE")" 2>/dev/null || ((SECONDS > deadline)); then
        echo "ray-up: the head did not come up within ${TIMEOUT}s; last lines of $DIR/ray.log:" >&2
        tail -n 20 "$DIR/ray.log" >&2
        "$(dirname "$0")/ray-down.sh" >/dev/null 2>&1 || true
        exit 1
    fi
    sleep 1
done

echo "Ray head on 127.0.0.1:$PORT (job API http://127.0.0.1:$DASHBOARD_PORT), token auth on, pid $(cat "$PID_FILE")"
echo "To use it:  source $DIR/ray.env"
cat "$DIR/ray.env"
