#!/usr/bin/env bash
# Build the peer and validator images without a registry: no Docker Hub, no PyTorch index.
#
#   scripts/build_images.sh            # base (if missing), wheelhouse (if stale), both images
#   scripts/build_images.sh --rebuild-base
#
# Three steps, each reused when it is already done:
#   1. the base image ($BASE_IMAGE, sparseloco-base:bookworm): Debian bookworm from the Debian
#      archive with mmdebstrap (minbase + python3 3.11, python3-venv, ca-certificates), imported
#      with `docker import`. Built when the engine does not have it (--rebuild-base: always).
#   2. the wheelhouse (build/wheelhouse, git-ignored, inside the build context): torch==$TORCH_VERSION
#      and every dependency of the project with its hf and s3-demo extras, plus setuptools and wheel
#      to build the project, collected with `pip wheel` by $PYTHON (a CPython 3.11, the base's
#      Python), from whatever index that pip is configured with. Collected again only when
#      pyproject.toml or TORCH_VERSION changed (build/wheelhouse/.stamp).
#   3. both images FROM the base, with `pip install --no-index --find-links /wheels` (the Dockerfiles'
#      PIP_NO_INDEX / PIP_FIND_LINKS build arguments); the engine's layer cache makes a second
#      build with no change take seconds (`docker image prune` drops the untagged first stages,
#      and with them that cache).
#
# Needs: a running Docker engine (`docker info`), mmdebstrap (apt-get install mmdebstrap) and root
# (or a user that mmdebstrap can run as) for step 1, a Python 3.11 with pip for step 2. Every step
# says what it does; Ctrl-C stops the step that runs and removes what it left half-done.
#
# Settings (environment, default):
#   BASE_IMAGE (sparseloco-base:bookworm)   PEER_IMAGE (sparseloco-peer)
#   VALIDATOR_IMAGE (sparseloco-validator)  TORCH_VERSION (2.13.0)
#   PYTHON (.venv/bin/python if present, else python3)   DEBIAN_MIRROR (the Debian default)
#   IMAGES (peer validator: which images to build)
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-sparseloco-base:bookworm}
PEER_IMAGE=${PEER_IMAGE:-sparseloco-peer}
VALIDATOR_IMAGE=${VALIDATOR_IMAGE:-sparseloco-validator}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
IMAGES=${IMAGES:-peer validator}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELHOUSE=build/wheelhouse
REBUILD_BASE=0
for arg in "$@"; do
    case "$arg" in
        --rebuild-base) REBUILD_BASE=1 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

step() { printf '\n==> %s\n' "$*" >&2; }
took() { printf '    done in %ss\n' "$((SECONDS - $1))" >&2; }

TMP=$(mktemp -d)
PARTIAL=""  # what an interrupted step leaves half-done (removed on exit)
cleanup() {
    rm -rf "$TMP"
    if [ -n "$PARTIAL" ]; then
        echo "removing the unfinished $PARTIAL" >&2
        rm -rf "$PARTIAL"
    fi
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

docker info >/dev/null 2>&1 || { echo "no Docker engine answers (docker info failed)" >&2; exit 3; }

# 1. The base image ----------------------------------------------------------------------------
if [ "$REBUILD_BASE" = 1 ] || ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null || { echo "mmdebstrap is missing: apt-get install mmdebstrap" >&2; exit 3; }
    step "base image $BASE_IMAGE: Debian bookworm (minbase + python3, python3-venv) with mmdebstrap"
    t=$SECONDS
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        --aptopt='Acquire::Retries "3"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
        bookworm "$TMP/base.tar" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"}
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$TMP/base.tar" "$BASE_IMAGE" >/dev/null
    rm -f "$TMP/base.tar"
    took "$t"
else
    step "base image $BASE_IMAGE: present, reused (--rebuild-base builds it again)"
fi

# 2. The wheelhouse ----------------------------------------------------------------------------
stamp="torch==$TORCH_VERSION $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$WHEELHOUSE/.stamp" 2>/dev/null)" != "$stamp" ]; then
    step "wheelhouse $WHEELHOUSE: torch==$TORCH_VERSION and the project's dependencies (hf, s3-demo)"
    t=$SECONDS
    version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$version" != 3.11 ]; then
        echo "$PYTHON is Python $version; the base image has 3.11: set PYTHON to a Python 3.11" >&2
        exit 3
    fi
    PARTIAL=$WHEELHOUSE.new
    rm -rf "$PARTIAL"
    "$PYTHON" -m pip wheel --progress-bar off --wheel-dir "$PARTIAL" \
        "torch==$TORCH_VERSION" "setuptools>=68" wheel ".[hf,s3-demo]"
    rm -f "$PARTIAL"/sparseloco-*.whl  # the project is installed from its source, not from here
    echo "$stamp" >"$PARTIAL/.stamp"
    rm -rf "$WHEELHOUSE"
    mv "$PARTIAL" "$WHEELHOUSE"
    PARTIAL=""
    echo "    $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)" >&2
    took "$t"
else
    step "wheelhouse $WHEELHOUSE: up to date, reused"
fi

# 3. The images --------------------------------------------------------------------------------
offline=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheels)
for image in $IMAGES; do
    case "$image" in
        peer) tag=$PEER_IMAGE; args=(-f Dockerfile --build-arg "TORCH_SPEC=torch==$TORCH_VERSION") ;;
        validator) tag=$VALIDATOR_IMAGE; args=(-f Dockerfile.validator --build-arg "TORCH_VERSION=$TORCH_VERSION") ;;
        *) echo "unknown image: $image (peer, validator)" >&2; exit 2 ;;
    esac
    step "image $tag FROM $BASE_IMAGE, offline from $WHEELHOUSE"
    t=$SECONDS
    docker build "${offline[@]}" "${args[@]}" -t "$tag" .
    echo "    $tag: $(docker image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')" >&2
    took "$t"
done
