# Ferry on CUDA: ONNX Runtime (onnxruntime-gpu 1.31 wants CUDA 13 / cuDNN 9) and PyTorch use the GPU when one is visible.
# Build:  docker build -t ferry .
# Run:    docker run --gpus all -p 8001:8001 -p 8002:8002 -v "$PWD/model_repository:/models:ro" ferry
FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/ferry \
    PATH=/opt/ferry/bin:$PATH

# The distribution's python3 tracks the base image's release; pinning its patch version breaks rebuilds.
# gcc: on a machine without a GPU, generation models build their CPU decode attention kernel at load
# (server/backends/llm/cpu_decode.py); without it they fall back to a slower path.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/ferry

WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY protos ./protos
COPY server ./server
COPY clients ./clients
RUN pip install --no-cache-dir . \
    && useradd --system --no-create-home --uid 10001 ferry

USER 10001
EXPOSE 8000 8001 8002
# The check runs `ferry health` (ServerLive + ServerReady, open to probes even with tokens on). With TLS,
# give it what a client needs, e.g. -e FERRY_HEALTH_ARGS="--root-certs /certs/ca.pem --tls-server-name ferry
# --client-cert /certs/probe.pem --client-key /certs/probe.key" (the last two only with --tls-ca).
ENV FERRY_HEALTH_ARGS=""
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s CMD ["sh", "-c", "ferry health --url 127.0.0.1:8001 --timeout 3 $FERRY_HEALTH_ARGS"]
ENTRYPOINT ["ferry", "serve", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
CMD ["--model-repository", "/models"]
