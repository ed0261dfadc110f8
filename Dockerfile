# hlbp peer image for cloud spot instances and servers. Configure it only through HLBP_* environment variables:
#   docker build -t hlbp .
#   docker run -v hlbp-data:/data -p 31337:31337 -e HLBP_INITIAL_PEERS=/ip4/1.2.3.4/tcp/31337/p2p/12D3... hlbp
# The peer handles SIGTERM (docker stop, a spot reclaim): it leaves the round, saves its checkpoint and exits.
# `make image` builds it with docker, podman or buildah; `make image-test` runs a run of containers from it.
#
# Build arguments:
#   BASE         any Debian-like image with python3 (3.11-3.13) and its venv module; a machine without a registry
#                builds from a local one (`make image` makes it with debootstrap)
#   TORCH_INDEX  where torch comes from: PyTorch's CPU index (the default, no CUDA libraries in the image);
#                https://pypi.org/simple for the CUDA build a GPU host runs; "local" for a wheel in docker/wheels/ (its dependencies from PyPI)
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/hlbp/venv \
    PATH=/opt/hlbp/venv/bin:$PATH \
    HLBP_CACHE=/data/cache \
    HLBP_OUT_DIR=/data/run \
    HLBP_IDENTITY=/data/identity.key \
    HLBP_HOST_MADDRS=/ip4/0.0.0.0/tcp/31337

WORKDIR /opt/hlbp
RUN python3 -m venv "$VIRTUAL_ENV" && useradd --create-home --uid 10001 --user-group hlbp \
    && mkdir -p /data && chown hlbp:hlbp /data
# jemalloc: a peer command starts itself again with it preloaded (peer/common/allocator.py), 2.5-4.5 bytes per
# parameter less at a full replica's peak; a base that cannot reach its package index builds without it
RUN (apt-get update && apt-get install -y --no-install-recommends libjemalloc2 && rm -rf /var/lib/apt/lists/*) \
    || echo "libjemalloc2 not installed: peers of this image run glibc's malloc"
# a CA bundle for pip when the build reaches the package index through a TLS-inspecting proxy (image.sh copies
# the one named by PIP_CERT into docker/certs/; without one, the base's own CAs are used)
COPY docker/certs/ /tmp/certs/
# torch first and on its own layer: it is most of the image and changes least
COPY docker/wheels/ /tmp/wheels/
RUN if [ -f /tmp/certs/ca.pem ]; then export PIP_CERT=/tmp/certs/ca.pem; fi \
    && if [ "$TORCH_INDEX" = local ]; then \
      pip install --find-links /tmp/wheels "torch==${TORCH_VERSION}"; \
    else \
      pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; \
    fi && rm -rf /tmp/wheels
# the versions the project's tests ran with (docker/constraints.txt), so the image gets no untested release
COPY docker/constraints.txt /tmp/constraints.txt
COPY pyproject.toml setup.py README.md ./
COPY peer ./peer
COPY protocol ./protocol
COPY cli ./cli
COPY bootstrap ./bootstrap
RUN if [ -f /tmp/certs/ca.pem ]; then export PIP_CERT=/tmp/certs/ca.pem; fi \
    && pip install -c /tmp/constraints.txt ".[hf]" && rm -rf build /tmp/constraints.txt /tmp/certs
COPY docker/entrypoint.sh /usr/local/bin/hlbp-entrypoint

VOLUME ["/data"]
EXPOSE 31337
# the peer's own listener answering is the sign of life (a peer waiting for a round writes nothing)
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, socket; socket.create_connection(('127.0.0.1', int(os.environ['HLBP_HOST_MADDRS'].split('/tcp/')[1].split('/')[0])), 3).close()"]
# exec form, and the entry point execs hlbp: hlbp is PID 1 and receives SIGTERM itself
ENTRYPOINT ["hlbp-entrypoint"]
CMD ["join"]
