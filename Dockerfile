# MemPO's images: one target per service, from one Dockerfile (docs/operations.md, "Images").
#
#   docker build --target retrieval -t mempo-retrieval .       # also: scorer, learner, rollout, redis
#   docker build --target rollout --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.23 -t mempo-rollout-gpu .
#
# BASE_IMAGE: any image with python3 (3.10+) and its venv module. The default, the public
# python:3.11-slim, gets the exact CPU stack (constraints/cpu.txt, torch from PyTorch's CPU
# index). A base that already ships torch (PyTorch's CUDA images, SGLang's) keeps every
# package it has and gains only what is missing: no second torch. Air-gapped: put wheels in
# docker/wheels (scripts/wheelhouse) and pip reads only them. No secret enters a layer:
# every token and password comes from the environment at run time.
ARG BASE_IMAGE=python:3.11-slim

# ----------------------------------------------------------------- python: the venv
FROM ${BASE_IMAGE} AS python
# TOKENIZERS_PARALLELISM is no secret (DL3064 flags names with TOKEN)
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    TOKENIZERS_PARALLELISM=false \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# --system-site-packages: a GPU base's torch stays visible (and untouched); a base whose
# python3 has no ensurepip makes the venv without pip and uses its own pip
RUN python3 -m venv --system-site-packages /opt/venv \
 || python3 -m venv --system-site-packages --without-pip /opt/venv

# ----------------------------------------------------------------- build: the packages
FROM python AS build
WORKDIR /src
COPY docker/install.sh docker/
COPY docker/wheels/ /tmp/wheels/
COPY constraints/cpu.txt constraints/
COPY pyproject.toml ./
# The dependencies alone (the package still empty, its readme a stand-in): cached until
# pyproject.toml or the constraints change, whatever else does.
RUN touch README.md && docker/install.sh deps
COPY README.md ./
COPY mempo ./mempo
COPY mempo_sim ./mempo_sim
COPY mempo_cli ./mempo_cli
COPY services ./services
RUN docker/install.sh app

# ----------------------------------------------------------------- app: what every service runs
FROM python AS app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/mempo /opt/mempo
RUN useradd --no-log-init --create-home --uid 10001 mempo \
 && mkdir -p /weights /runs /cache /data /models \
 && chown mempo:mempo /weights /runs /cache
ENV MEMPO_CACHE=/cache
WORKDIR /home/mempo
USER 10001

FROM app AS retrieval
ENV MEMPO_RETRIEVAL_HOST=0.0.0.0 MEMPO_RETRIEVAL_PORT=8001
EXPOSE 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/ready', timeout=4)"]
CMD ["mempo", "retrieval", "serve"]

FROM app AS scorer
ENV MEMPO_SCORER_HOST=0.0.0.0 MEMPO_SCORER_PORT=8002 MEMPO_SCORER_WEIGHTS_ROOT=/weights
EXPOSE 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8002/ready', timeout=4)"]
CMD ["mempo", "scorer", "serve"]

FROM app AS learner
ENV MEMPO_LEARNER_HOST=0.0.0.0 \
    MEMPO_LEARNER_PORT=8004 \
    MEMPO_LEARNER_RUN_DIR=/runs/learner \
    MEMPO_LEARNER_WEIGHTS_ROOT=/weights \
    MEMPO_LEARNER_EXIT_ON_ERROR=true
EXPOSE 8004
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8004/health', timeout=4)"]
CMD ["mempo", "learner", "serve"]

# One replica: an engine (SGLang on a GPU base, the CPU engine otherwise) and its worker.
# The engine listens on 127.0.0.1 inside the container; only the worker's 8003 is exposed.
FROM app AS rollout
COPY services/rollout/entrypoint.sh /opt/mempo/rollout-entrypoint.sh
ENV ENGINE=cpu \
    ENGINE_PORT=30000 \
    MEMPO_ROLLOUT_HOST=0.0.0.0 \
    MEMPO_ROLLOUT_PORT=8003 \
    MEMPO_ENGINE_WEIGHTS_ROOT=/weights
EXPOSE 8003
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8003/ready', timeout=4)"]
ENTRYPOINT ["/opt/mempo/rollout-entrypoint.sh"]

# Redis for a stack without registry access: Debian's redis-server. The entrypoint matches
# the official image's (it drops root and runs its arguments as the redis user), so the
# compose file's redis command runs unchanged on either image.
FROM ${BASE_IMAGE} AS redis
# Debian stable's redis-server, with its security updates (a version pin breaks on each)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
COPY docker/redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=20 CMD ["sh", "-c", "redis-cli ping | grep -q PONG"]
CMD ["docker-entrypoint.sh", "redis-server", "--dir", "/data"]
