#!/usr/bin/env bash
# infra/local/s3-up.sh         start a local S3-compatible endpoint (moto server) on 127.0.0.1
# infra/local/s3-down.sh       stop it (by the pid recorded in the pid file)
#
# For trying s3:// paths on one machine, exactly as with R2 or S3:
#   infra/local/s3-up.sh && source "${BUCKETEER_LOCAL_DIR:-/tmp/bucketeer-local}/s3.env"
#   bucketeer scan s3://bucketeer/dataset --out s3://bucketeer/manifest \
#       --storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'
# The server keeps everything in memory: stopping it deletes the data. It accepts any credentials;
# the ones in s3.env are placeholders so that botocore signs requests.
#
# Environment (all optional): BUCKETEER_LOCAL_DIR (state folder), S3_PORT (9000), S3_BUCKET
# (bucket created at start, "bucketeer"), PYTHON (interpreter with moto[server], "python").
set -euo pipefail

DIR="${BUCKETEER_LOCAL_DIR:-/tmp/bucketeer-local}"
PORT="${S3_PORT:-9000}"
BUCKET="${S3_BUCKET:-bucketeer}"
PY="${PYTHON:-python}"
PID_FILE="$DIR/s3.pid"
ENDPOINT="http://127.0.0.1:$PORT"

mkdir -p "$DIR"
if [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
    echo "s3-up: a server started from $DIR is already running (pid $(cat "$PID_FILE")); stop it with infra/local/s3-down.sh" >&2
    exit 1
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
    echo "s3-up: port $PORT on 127.0.0.1 is already in use; choose another with S3_PORT=..." >&2
    exit 1
fi

setsid "$PY" -m moto.server -H 127.0.0.1 -p "$PORT" >"$DIR/s3.log" 2>&1 </dev/null &
echo $! >"$PID_FILE"

deadline=$((SECONDS + 30))
until (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; do
    if ! kill -0 "$(cat "$PID_FILE")" 2>/dev/null || ((SECONDS > deadline)); then
        echo "s3-up: the server did not start; last lines of $DIR/s3.log:" >&2
        tail -n 20 "$DIR/s3.log" >&2
        "$(dirname "$0")/s3-down.sh" >/dev/null 2>&1 || true
        exit 1
    fi
    sleep 0.2
done

cat >"$DIR/s3.env" <<ENV
# source this file to reach the local S3-compatible server started by infra/local/s3-up.sh
export AWS_ACCESS_KEY_ID=local-test-key
export AWS_SECRET_ACCESS_KEY=local-test-secret
export AWS_DEFAULT_REGION=us-east-1
export AWS_ENDPOINT_URL=$ENDPOINT
ENV
# shellcheck disable=SC1091
source "$DIR/s3.env"
"$PY" -c 'import sys, s3fs; s3fs.S3FileSystem(client_kwargs={"endpoint_url": sys.argv[1]}).mkdir(sys.argv[2])' "$ENDPOINT" "$BUCKET"

echo "S3-compatible server on $ENDPOINT (bucket s3://$BUCKET), pid $(cat "$PID_FILE")"
echo "To use it:  source $DIR/s3.env    and pass  --storage-options '{\"endpoint_url\": \"$ENDPOINT\"}'"
cat "$DIR/s3.env"
