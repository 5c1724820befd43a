# The raylm image the Helm chart runs by default (helm/raylm values.yaml: image.repository
# raylm/raylm, tag = the chart's appVersion). Build from the repository root:
#   docker build -t raylm/raylm:0.1.0 .
# A Ray GPU image (CUDA runtime, Ray of the version the KubeRay autoscaler expects), a CUDA
# build of torch (the CPU wheel would leave the GPUs idle: raylm refuses to start a rank on
# CPU when Ray gave it a GPU), then raylm itself.
ARG RAY_VERSION=2.60.0
ARG CUDA_TAG=cu128
FROM rayproject/ray:${RAY_VERSION}-py311-${CUDA_TAG}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

LABEL org.opencontainers.image.title="raylm" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="raylm LLM serving engine on Ray, CUDA build"

# Torch first, from the CUDA index, so that installing raylm keeps it (torch==2.13.0 is
# satisfied by 2.13.0+cu128) instead of pulling the CPU wheel.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /home/ray/raylm
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users api ./api
COPY --chown=ray:users scheduler ./scheduler
COPY --chown=ray:users runner ./runner
COPY --chown=ray:users parallel ./parallel
COPY --chown=ray:users actors ./actors
COPY --chown=ray:users cluster ./cluster
RUN pip install --no-cache-dir . && python -c "import raylm, torch; print(raylm.__version__, torch.__version__)"

WORKDIR /home/ray
