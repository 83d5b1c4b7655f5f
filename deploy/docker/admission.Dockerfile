# Sluice admission service (gRPC on 50051, OpenAI-compatible HTTP on 8000): the server extra, no torch;
# the model directory (its tokenizer) is mounted at /models.
# Build from the repository root:  docker build -f deploy/docker/admission.Dockerfile -t sluice-admission .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY sluice ./sluice
COPY admission_svc ./admission_svc
COPY router_svc ./router_svc
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
RUN pip install ".[server]" grpcio-tools==1.85.1 \
 && python scripts/gen_protos.py \
 && pip uninstall -y grpcio-tools
RUN useradd --create-home sluice && mkdir -p /models && chown sluice /models
USER sluice
EXPOSE 50051
EXPOSE 8000
ENTRYPOINT ["python", "-m", "admission_svc", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000"]
