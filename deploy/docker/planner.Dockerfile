# Sluice image: the planner (sizes the replica Deployment through the Kubernetes API).
# Installs the wheel with exactly the extras [server,planner] its entrypoint needs
# (tests/e2e/test_images.py reads the install line below and runs the entrypoint and the HEALTHCHECK in a
# fresh virtualenv holding only that install).
# Build from the repository root:  podman build -f deploy/docker/planner.Dockerfile -t sluice-planner:0.1.0 .
# BASE is a tag here; pin it by digest where your registry has one: --build-arg BASE=python:3.11-slim@sha256:...
ARG BASE=python:3.11-slim

# Stage 1: build the wheel (setup.py generates sluice/v1 from protos/; grpcio-tools is a build requirement).
FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY sluice ./sluice
COPY admission_svc ./admission_svc
COPY router_svc ./router_svc
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY planner_svc ./planner_svc
RUN pip wheel --no-deps -w /dist .

# Stage 2: the runtime, the wheel and its extras only; no compiler, no sources, no build tools.
FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /dist /dist
RUN pip install "$(echo /dist/sluice-*.whl)[server,planner]" && rm -rf /dist
WORKDIR /app
# Non-root by uid (Kubernetes' runAsNonRoot checks a numeric USER); /models is where the model is mounted.
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin sluice \
 && mkdir -p /models && chown 10001:10001 /models
USER 10001:10001
EXPOSE 50081
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-m", "sluice.healthcheck", "50081", "--role", "planner"]
ENTRYPOINT ["python", "-m", "planner_svc", "--host", "0.0.0.0", "--port", "50081"]
