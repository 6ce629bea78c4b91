#!/usr/bin/env bash
# infra/local/s3-down.sh       stop the S3-compatible server started by infra/local/s3-up.sh (its data is lost)
set -euo pipefail

DIR="${BUCKETEER_LOCAL_DIR:-/tmp/bucketeer-local}"
PID_FILE="$DIR/s3.pid"

if [[ ! -f "$PID_FILE" ]]; then
    echo "s3-down: no $PID_FILE; nothing to stop"
    exit 0
fi
pid="$(cat "$PID_FILE")"
[[ "$pid" =~ ^[0-9]+$ ]] || { echo "s3-down: $PID_FILE does not hold a pid" >&2; exit 1; }
kill -TERM -- "-$pid" 2>/dev/null || true
for _ in $(seq 1 20); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 0.25
done
kill -KILL -- "-$pid" 2>/dev/null || true
rm -f "$PID_FILE" "$DIR/s3.env"
echo "S3-compatible server (pid $pid) stopped"
