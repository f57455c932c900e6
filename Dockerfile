# syntax=docker/dockerfile:1.7
# fedmq images. Targets:
#   cpu   every role (aggregator without a GPU, agent, sim, fleet status); CPU-only torch and
#         onnxruntime. The agent image for an x86-64 edge box.           docker build --target cpu .
#   cuda  the aggregator on an NVIDIA host: PyPI's default torch wheel brings its own CUDA
#         libraries, so the base needs only the driver (NVIDIA Container Toolkit).
#                                                                         docker build --target cuda .
# Both run as the non-root user `fedmq` (uid 10001) with state under /var/lib/fedmq.
# docs/deploy.md says how large they come out and why.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --------------------------------------------------------------------------- build stages
FROM ${PYTHON_IMAGE} AS build-base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./

FROM build-base AS build-cpu
# CPU-only torch from PyTorch's own index (the PyPI wheel carries ~3 GB of CUDA libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url ${TORCH_INDEX_URL} -c constraints.txt torch torchvision
COPY fedmq fedmq
COPY aggregator aggregator
COPY edge_agent edge_agent
COPY sim sim
RUN pip install -c constraints.txt ".[cpu]" \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} + \
 && find /opt/venv -name 'tests' -path '*site-packages/*/tests' -prune -exec rm -rf {} +

FROM build-base AS build-cuda
COPY fedmq fedmq
COPY aggregator aggregator
COPY edge_agent edge_agent
COPY sim sim
RUN pip install -c constraints.txt ".[gpu]" \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

# ------------------------------------------------------------------------- runtime stages
FROM ${PYTHON_IMAGE} AS runtime-base
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    FEDMQ_DATA_DIR=/var/lib/fedmq/data MPLCONFIGDIR=/tmp/matplotlib
RUN groupadd --system --gid 10001 fedmq \
 && useradd --system --uid 10001 --gid fedmq --home-dir /var/lib/fedmq --shell /usr/sbin/nologin fedmq \
 && mkdir -p /var/lib/fedmq/data /var/lib/fedmq/agents /var/lib/fedmq/aggregator /var/lib/fedmq/results /etc/fedmq \
 && chown -R fedmq:fedmq /var/lib/fedmq
WORKDIR /var/lib/fedmq
# Example configs (compose mounts its own over them) and the identity helper for scaled agents.
COPY deploy/*.toml /etc/fedmq/
COPY deploy/claim_agent.py /opt/fedmq/claim_agent.py
STOPSIGNAL SIGTERM
ENTRYPOINT []

FROM runtime-base AS cpu
COPY --from=build-cpu /opt/venv /opt/venv
# pip installs the project non-editable, so the source tree is not needed at run time.
USER fedmq
CMD ["fedmq", "--help"]

FROM runtime-base AS cuda
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build-cuda /opt/venv /opt/venv
USER fedmq
CMD ["fedmq", "aggregator", "--help"]
