# Sluice worker service: torch CPU wheel; for CUDA use an nvidia/cuda base with python3.11 and the CUDA torch wheel.
# Build from the repository root:  docker build -f deploy/docker/worker.Dockerfile -t sluice-worker .
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
# sluice_tools (not in the installed package) for the model-init containers: python -m sluice_tools.cli model init
COPY sluice_tools ./sluice_tools
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[worker]" grpcio-tools==1.85.1 \
 && python scripts/gen_protos.py \
 && pip uninstall -y grpcio-tools
RUN useradd --create-home sluice && mkdir -p /models && chown sluice /models
USER sluice
EXPOSE 50061
ENTRYPOINT ["python", "-m", "worker_svc", "--host", "0.0.0.0", "--port", "50061"]
