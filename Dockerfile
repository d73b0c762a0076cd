# rollserve GPU image: `docker run --gpus all IMAGE serve --actor /models/actor` serves on 50051;
# `docker run IMAGE health --target HOST:50051` probes a server. Every `serve` flag --foo-bar is
# also the variable ROLLSERVE_FOO_BAR (`docker run IMAGE serve --help`).
#
# Build: docker build -t rollserve:0.1.0 .
# tests/test_deploy_files.py checks this file against the CLI, docker-compose.yml and deploy/k8s.

# Official PyTorch CUDA runtime image, pinned: it brings CUDA, cuDNN, Python and torch 2.13, so
# the project's `torch>=2.11` requirement is already met and pip never downloads another torch.
# CUDA 12.6 runs on drivers >= 560; pass --build-arg BASE_IMAGE=... for another CUDA build.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

# Extras of pyproject.toml to install: `server` for `rollserve serve`, `examples` (matplotlib)
# so docker-compose.yml's trainer runs from the same image.
ARG EXTRAS=server,examples

# MALLOC_*: the glibc settings measured in docs/reference/transport.md (same as the Makefile):
# no mmap/munmap page-fault storm for every ~1 MiB gRPC message of a weight stream.
# HF_HUB_OFFLINE: models come from directories under /models; never reach for a hub.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MALLOC_MMAP_THRESHOLD_=33554432 \
    MALLOC_TRIM_THRESHOLD_=1073741824 \
    MALLOC_TOP_PAD_=67108864 \
    HF_HUB_OFFLINE=1 \
    ROLLSERVE_HOST=0.0.0.0

# A C compiler and libc headers: Triton, torch.compile's CUDA backend (the engine's decode step and
# scoring forward on a GPU), builds each kernel's launcher with one at run time. Without it every
# compiled function falls back to eager (the server logs why) and generation runs several times
# slower. pytorch/pytorch's runtime images long shipped none (pytorch/pytorch#116696); installed
# here so that any BASE_IMAGE serves at full speed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --gid 10001 rollserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin rollserve \
    && mkdir -p /models /out \
    && chown rollserve:rollserve /models /out

WORKDIR /app

# Layer 1, rebuilt only when pyproject.toml changes: the dependencies. Empty package folders let
# setuptools build the project without its sources; the placeholder is uninstalled right after.
# The constraint pins the base image's torch, so a resolver change can never swap it out.
COPY pyproject.toml README.md ./
RUN mkdir -p client/protocol/experience client/weights server/algorithms server/config \
        server/continuous server/engine server/experience server/generation server/models \
        server/serving server/weights protos/rollserve/v1 \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch.txt \
    && pip install --no-cache-dir --constraint /tmp/torch.txt ".[${EXTRAS}]" \
    && pip uninstall --yes rollserve \
    && rm -rf build ./*.egg-info

# Layer 2, rebuilt on every source change: the project itself, without touching dependencies.
COPY protos/ protos/
COPY client/ client/
COPY server/ server/
RUN pip install --no-cache-dir --no-deps . \
    && rm -rf build ./*.egg-info \
    && rollserve serve --help > /dev/null

# The example trainer that docker-compose.yml runs (`python examples/train_grpo.py`).
COPY examples/ examples/

# Model directories (actor, reference, critic, reward) are mounted here, read-only is fine.
VOLUME ["/models"]
USER 10001:10001

# 50051: gRPC (Rollout, grpc.health.v1, reflection); 9090: Prometheus metrics (--metrics-port).
EXPOSE 50051 9090

# SIGTERM: health goes NOT_SERVING for --drain-delay-s, in-flight calls get --shutdown-grace-s,
# then exit 0. Give `docker stop -t` more than their sum (docker-compose.yml does).
STOPSIGNAL SIGTERM

# start-period: failures while large models load do not count; the first success counts at once.
# The Docker timeout exceeds the probe's own --timeout-s so the probe reports, not Docker.
HEALTHCHECK --interval=10s --timeout=10s --start-period=600s --retries=3 \
    CMD ["rollserve", "health", "--target", "127.0.0.1:50051", "--timeout-s", "5"]

ENTRYPOINT ["rollserve"]
CMD ["serve"]
