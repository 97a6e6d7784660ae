# chronomq: one broker node per container. Configuration comes from CHRONOMQ_* variables
# (every key of `chronomq config reference`); data lives in the /data volume.
# See compose.yaml for a 3-node cluster.
#
# Two images from this file:
#   docker build -t chronomq .                          the broker (default): no Java, no Spark
#   docker build --target report -t chronomq-report .   `chronomq report`: Spark and Java 17

# ---- build: install the package and its dependencies into a virtual environment
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY .ci/constraints.txt ./constraints.txt
COPY raftlog ./raftlog
COPY schedule ./schedule
COPY timer ./timer
COPY pop ./pop
COPY cluster ./cluster
COPY ops ./ops
COPY chronomq ./chronomq
RUN python -m venv /opt/chronomq \
    && /opt/chronomq/bin/pip install -c constraints.txt .

# ---- build-report: the same, with the Spark extra
FROM build AS build-report
RUN /opt/chronomq/bin/pip install -c constraints.txt '.[report]'

# ---- base: Python, a non-root user and the data directory
FROM python:3.11-slim-bookworm AS base
# Debian replaces exact package versions with security updates, so pinning one would break
# the build within weeks; the base image tag fixes the Debian release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends procps \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin chronomq \
    && mkdir -p /data \
    && chown chronomq:chronomq /data
ENV PATH=/opt/chronomq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CHRONOMQ_DATA_DIR=/data \
    CHRONOMQ_HTTP_HOST=0.0.0.0 \
    CHRONOMQ_HTTP_PORT=8080 \
    CHRONOMQ_RAFT_PORT=9080 \
    CHRONOMQ_LOG_FORMAT=json
WORKDIR /data

# ---- report: `chronomq report` with Spark on a Java 17 runtime
FROM base AS report
# Unpinned for the same reason as in base: the base image tag fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-report /opt/chronomq /opt/chronomq
ENV SPARK_LOCAL_IP=127.0.0.1
USER 10001:10001
ENTRYPOINT ["chronomq"]
CMD ["report", "--help"]

# ---- broker (the default image): one node
FROM base AS broker
COPY --from=build /opt/chronomq /opt/chronomq
# CHRONOMQ_RAFT_HOST must be the name peers use to reach this node (see compose.yaml). HTTP
# binds every interface of the container, so a node refuses to start without a cluster secret
# and an auth token (CHRONOMQ_CLUSTER_SECRET and CHRONOMQ_AUTH_TOKEN, or their *_FILE keys
# naming 0600 files): pass them from an env file or a secret, never as image layers.
# The numeric id, so the runtime needs no passwd lookup to drop privileges.
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8080 8180 9080 10080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CHRONOMQ_HTTP_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["chronomq"]
CMD ["node"]
