# The engine's image for the Kubernetes patterns (deploy/k8s): vLLM's own image with
# kvstore's client (kvstore.client.vllm, the KV connector) installed beside it.
#
#   docker build -f deploy/docker/vllm.Dockerfile -t kvstore-vllm:0.1.0 .
#
# The client needs no torch of its own: vLLM's satisfies kvstore's requirement, so
# pip keeps it. Both containers of a pod run as uid 10001 (the daemon's socket and
# shared-memory segments are its user's alone).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src/kvstore
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY predictor ./predictor
COPY client ./client
RUN python3 -m pip install . \
    && useradd --system --uid 10001 --create-home --home-dir /home/vllm vllm
WORKDIR /home/vllm
USER 10001:10001
