#!/usr/bin/env bash
# infra/local/ray-down.sh      stop the Ray head started by infra/local/ray-up.sh
#
# Kills only that head's process group (recorded in its pid file): other Ray instances on this
# machine are left alone, which `ray stop` would not do.
set -euo pipefail

DIR="${BUCKETEER_LOCAL_DIR:-/tmp/bucketeer-local}"
PID_FILE="$DIR/ray.pid"
# Ray's own shutdown on SIGTERM waits on its processes one after another (and, from 2.5x, a node drain whose GCS
# the same signal stops): ~30 s on a local head that holds nothing worth the wait, so 10 s, then SIGKILL
TIMEOUT="${RAY_STOP_TIMEOUT:-10}"

if [[ ! -f "$PID_FILE" ]]; then
    echo "ray-down: no $PID_FILE; nothing to stop"
    exit 0
fi
pgid="$(cat "$PID_FILE")"
[[ "$pgid" =~ ^[0-9]+$ ]] || { echo "ray-down: $PID_FILE does not hold a pid" >&2; exit 1; }

# SIGTERM lets `ray start --block` shut its processes down; SIGKILL whatever is left after TIMEOUT
kill -TERM -- "-$pgid" 2>/dev/null || true
deadline=$((SECONDS + TIMEOUT))
while kill -0 -- "-$pgid" 2>/dev/null; do
    if ((SECONDS > deadline)); then
        kill -KILL -- "-$pgid" 2>/dev/null || true
        sleep 1
        break
    fi
    sleep 0.5
done
rm -f "$PID_FILE" "$DIR/ray.env" "$DIR/ray/ray_current_cluster"
echo "Ray head (process group $pgid) stopped"
