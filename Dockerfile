# hlbp peer image for cloud spot instances. Configure it only through HLBP_* environment variables, e.g.
#   docker run -e HLBP_INITIAL_PEERS=/ip4/1.2.3.4/tcp/31337/p2p/12D3... -p 31337:31337 hlbp
# The node handles SIGTERM (docker stop, spot reclaim): it leaves the round cleanly, saves and exits.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HLBP_CACHE=/data/cache \
    HLBP_OUT_DIR=/data/run \
    HLBP_IDENTITY=/data/identity.key

WORKDIR /opt/hlbp
# CPU torch first, from PyTorch's CPU index, so the image does not carry the multi-GB CUDA build.
# Build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 for a GPU image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX}"
COPY pyproject.toml setup.py README.md ./
COPY peer ./peer
COPY protocol ./protocol
COPY cli ./cli
COPY bootstrap ./bootstrap
RUN pip install ".[hf]" && useradd --create-home --uid 10001 hlbp && mkdir -p /data && chown hlbp /data

USER hlbp
VOLUME ["/data"]
EXPOSE 31337
# exec form: hlbp runs as PID 1 and receives SIGTERM itself, with no shell in between.
ENTRYPOINT ["hlbp"]
CMD ["join"]
