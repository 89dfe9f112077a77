# The peer image: CUDA PyTorch runtime, the project with its `hf` extra, and scripts/.
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
# torch comes with the base image (CUDA 12.8 wheels, for drivers >= 570); the project asks for
# torch>=2.4 only, so pip keeps it. Another CUDA or torch: --build-arg PYTORCH_IMAGE=<tag>.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPARSELOCO_CACHE=/state/cache

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY client ./client
COPY validator ./validator
COPY scripts ./scripts
# The project itself, from the build context (DL3013 asks for a version pin: this is the source).
# hadolint ignore=DL3013
RUN pip install ".[hf]" \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# /state (the volume) and /shared (where compose.yaml mounts the volume that carries run.toml to
# the peers) exist and belong to the runtime user before VOLUME: a fresh named volume is
# initialised from the directory it is mounted on, so --state /state is writable without root.
RUN useradd --create-home --uid 10001 --user-group --shell /bin/bash sparseloco \
    && mkdir -p /state/cache /shared \
    && chown -R 10001:10001 /state /shared
USER 10001:10001
VOLUME ["/state"]
ENTRYPOINT []
CMD ["sparseloco-peer", "--help"]
