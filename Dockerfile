# A peer or validator image. GPU users: build FROM a CUDA PyTorch image instead and drop the torch pin.
#   docker build -t sparseloco .
#   docker run --rm -v $PWD/run.toml:/run.toml -v sparseloco-state:/state sparseloco \
#       sparseloco-peer join --run /run.toml --state /state
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY client ./client
COPY validator ./validator
RUN pip install .
RUN useradd --create-home sparseloco
USER sparseloco
VOLUME ["/state"]
ENTRYPOINT []
CMD ["sparseloco", "--help"]
