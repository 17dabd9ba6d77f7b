# syntax=docker/dockerfile:1
# decode-worker image: CUDA runtime + RDMA user-space (verbs, rdmacm) for NIXL over UCX.
#
#   docker build -t decode-worker:0.1.0 .                      # the daemon (default target)
#   docker build --build-arg CUDA_VERSION=12.9.1 -t ... .      # another CUDA runtime
#   docker build --target router -t decode-worker-router:0.1.0 .   # SGLang Model Gateway (smg)
#
# Ports: 30000/tcp HTTP API + /health + /metrics (server.port); 8998/tcp ZMQ bootstrap of the
# reference prefill peer (`decode-worker prefill`, transfer.bootstrap_port). NIXL/UCX opens its
# own data connections (RDMA CM / ephemeral TCP) between pods: allow them node to node.
# Run with --gpus, --ulimit memlock=-1 and the RDMA devices (--device /dev/infiniband) for RDMA.
# See docs/DEPLOY.md.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS build
# Extra wheel index, e.g. the PyTorch index for a CUDA build other than PyPI's default torch.
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/decode-worker
WORKDIR /src
COPY deploy/requirements.lock deploy/requirements.lock
# Dependencies first (cached layer), every one pinned by the lock.
RUN /opt/decode-worker/bin/pip install -r deploy/requirements.lock
COPY pyproject.toml README.md ./
COPY decode_worker decode_worker
RUN /opt/decode-worker/bin/pip install --no-deps -c deploy/requirements.lock . \
    && /opt/decode-worker/bin/decode-worker config --json > /dev/null

FROM python:3.12-slim AS router
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install smg==1.13.0 \
    && useradd --system --uid 10001 --create-home router
USER 10001
# 8000: the router's HTTP API; 29000: its Prometheus metrics.
EXPOSE 8000 29000
ENTRYPOINT ["python", "-m", "smg.launch_router"]

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
LABEL org.opencontainers.image.title="decode-worker" \
      org.opencontainers.image.description="Decode worker for P/D disaggregated gpt-oss serving" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# python3 for the venv; rdma-core/ibverbs/rdmacm/numa are what UCX's RDMA transports load.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 rdma-core ibverbs-providers \
       libibverbs1 librdmacm1 libnuma1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/decode decode \
    && mkdir -p /var/cache/decode-worker /models \
    && chown decode:decode /var/cache/decode-worker
COPY --from=build /opt/decode-worker /opt/decode-worker
ENV PATH=/opt/decode-worker/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HOME=/home/decode \
    DECODE_WORKER_SERVER__HOST=0.0.0.0 \
    DECODE_WORKER_SERVER__PORT=30000 \
    DECODE_WORKER_MODEL__CACHE_DIR=/var/cache/decode-worker
USER 10001:10001
WORKDIR /home/decode
EXPOSE 30000/tcp 8998/tcp
# SIGTERM drains: /health turns 503 (still serving for server.drain_announce_s), then running
# requests get server.drain_grace_s, exit 0: `docker stop -t 60` covers the defaults.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('DECODE_WORKER_SERVER__PORT', '30000') + '/health', timeout=4)"]
ENTRYPOINT ["/opt/decode-worker/bin/decode-worker"]
CMD ["serve"]
