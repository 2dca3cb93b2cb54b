# kvstore's daemon image: `kvstore serve` on the embedded default (DRAM + LMDB) unless
# a config file or KVSTORE_* variables say otherwise (docs/deploy.md).
#
#   docker build -t kvstore:0.1.0 .
#   docker build -t kvstore:0.1.0-cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# CPU torch by default: a bare `torch` from PyPI is a multi-GB CUDA build. The CUDA
# wheels carry their own runtime libraries, so the same slim base serves both; the
# node provides the driver (NVIDIA's container toolkit). BASE_IMAGE swaps the base
# for one of your own (a hardened or a CUDA image with Python 3.11 or later).

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvstore
WORKDIR /src
RUN /opt/kvstore/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY predictor ./predictor
COPY client ./client
RUN /opt/kvstore/bin/pip install .

FROM ${BASE_IMAGE}
# The daemon runs as this user; its data and socket directories are its own. The
# arena lives in /dev/shm: give the container room there (docker run --shm-size, or
# an emptyDir of medium Memory in a pod) or the DRAM tier sizes itself down to what
# it finds, with a warning.
RUN groupadd --system --gid 10001 kvstore \
    && useradd --system --uid 10001 --gid kvstore --home-dir /var/lib/kvstore \
        --shell /usr/sbin/nologin kvstore \
    && install -d -o kvstore -g kvstore /var/lib/kvstore /run/kvstore
COPY --from=build /opt/kvstore /opt/kvstore
ENV PATH=/opt/kvstore/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSTORE_CONFIG=/etc/kvstore/kvstore.toml
COPY deploy/docker/kvstore.toml /etc/kvstore/kvstore.toml
USER 10001:10001
VOLUME ["/var/lib/kvstore"]
EXPOSE 7480
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["kvstore", "ready", "--live", "--url", "unix:///run/kvstore/kvstore.sock", "--timeout", "2"]
ENTRYPOINT ["kvstore"]
CMD ["serve"]
