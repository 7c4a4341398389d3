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
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
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
EXPOSE 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD ["python3", "-c", "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s=g.HealthStub(grpc.insecure_channel('127.0.0.1:8001')).Check(h.HealthCheckRequest(), timeout=2); sys.exit(0 if s.status == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["ferry", "serve", "--host", "0.0.0.0", "--grpc-port", "8001", "--metrics-port", "8002"]
CMD ["--model-repository", "/models"]
