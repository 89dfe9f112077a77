# The peer image: PyTorch (CUDA from the default base), the project with its `hf` extra, and scripts/.
#
#   docker build -t sparseloco-peer .
#   docker run --rm --gpus all -v $PWD/run.toml:/run/run.toml:ro -v sparseloco-peer:/state \
#       sparseloco-peer sparseloco-peer join --run /run/run.toml --state /state
#
# A run with a grant server needs no credential (run.toml names store.grant_url); otherwise pass
# the store's credential by environment: -e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY (and
# AWS_SESSION_TOKEN for temporary ones). The state volume holds the peer's key, its local state
# and the data cache; a named volume starts owned by the image's user (UID 10001). A bind mount
# keeps its host owner: chown it to 10001, or run with --user "$(id -u):$(id -g)".
#
# Build arguments (the defaults need Docker Hub and PyPI):
#   BASE_IMAGE     the image both stages start from. The default carries torch (CUDA 12.8 wheels,
#                  for drivers >= 570); the project asks for torch>=2.4 only, so pip keeps it.
#   TORCH_SPEC     a torch to install first ("": the base image's). A base without torch needs one.
#   PIP_INDEX_URL  the package index (pip reads it from the environment).
#   PIP_NO_INDEX, PIP_FIND_LINKS  unset by default; scripts/build_images.sh sets them to 1 and
#                  /wheels to build offline from build/wheelhouse (copied in when it exists).
#
# Two stages: the packages are installed into a virtual environment (/opt/venv, which sees the base
# image's own packages) in the first, and only that environment reaches the image, not the wheels.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE} AS build

ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
ARG TORCH_SPEC=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The offline wheelhouse when build/wheelhouse exists (the brackets make the glob match nothing
# otherwise; pyproject.toml keeps the source list non-empty). Its own layer: a source change
# does not copy or reinstall it.
COPY pyproject.toml build/wheelhous[e] /wheels/
# TORCH_SPEC is the pin (torch==<version>); hadolint cannot see through the argument.
# hadolint ignore=DL3013
RUN if [ -n "${TORCH_SPEC}" ]; then pip install "${TORCH_SPEC}"; fi
# The dependencies, from pyproject.toml alone (README.md, which it names, an empty stand-in): with
# no sources copied yet the project is an empty distribution, so this layer (the large one) stays
# cached while only the sources change. setuptools and wheel stay too: the second stage builds the
# project without an index.
WORKDIR /app
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN touch README.md && pip install ".[hf]" setuptools wheel \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

FROM ${BASE_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPARSELOCO_CACHE=/state/cache
# /state (the volume) and /shared (where compose.yaml mounts the volume that carries run.toml to
# the peers) exist and belong to the runtime user before VOLUME: a fresh named volume is
# initialised from the directory it is mounted on, so --state /state is writable without root.
RUN useradd --create-home --uid 10001 --user-group --shell /bin/bash sparseloco \
    && mkdir -p /state/cache /shared \
    && chown -R 10001:10001 /state /shared
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY client ./client
COPY validator ./validator
COPY scripts ./scripts
# The project itself, from the build context, over the empty one (its dependencies are in /opt/venv;
# DL3013 asks for a version pin: this is the source); python -I imports what was installed, not /app.
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation . \
    && rm -rf build ./*.egg-info \
    && python -I -c "import protocol, client, validator" && sparseloco-peer --help >/dev/null
USER 10001:10001
VOLUME ["/state"]
ENTRYPOINT []
CMD ["sparseloco-peer", "--help"]
