# The images the k8s/ manifests name, built from the project's own install steps (scripts/setup.sh):
# `pip install -c constraints.txt '.[extras]'` of this repository, uid 1000.
#
#   docker build --target dynrubric -t ghcr.io/your-org/dynrubric:0.1.0 .              # base/kustomization.yaml
#   docker build --target dynrubric-train -t ghcr.io/your-org/dynrubric-train:0.1.0 .  # train.openrlhf.image
#
# No container engine runs where this repository is built and tested, so the images are not built in CI;
# tests/integration/test_k8s.py checks that the stages are the images the manifests name, that every
# install keeps constraints.txt, and that every command and option the manifests give a dynrubric
# container parses with the `dynrubric` CLI (the entrypoint).

# ---- dynrubric: router, reward server, ingest consumer, rollout controller (all CPU)
FROM python:3.11-slim AS dynrubric
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /opt/dynrubric
COPY pyproject.toml constraints.txt README.md ./
COPY dynrubric ./dynrubric
COPY streaming ./streaming
COPY serving ./serving
# postgres: the registry (registry-url); confluent: ingest.client confluent. torch from PyTorch's CPU index:
# nothing in this image runs on a GPU (the engines are the vLLM image), and constraints.txt pins its version.
RUN pip install -c constraints.txt --extra-index-url https://download.pytorch.org/whl/cpu ".[postgres,confluent]" \
    && dynrubric --help >/dev/null
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin dynrubric
USER 1000
ENTRYPOINT ["dynrubric"]
CMD ["--help"]

# ---- dynrubric-train: the trainer RayJob's head and workers (OpenRLHF on Ray, vLLM on CUDA)
# Ray's own image at the rayVersion KubeRay is told (train.openrlhf.ray_version; openrlhf 0.11.2 pins 2.55.0);
# its user `ray` is uid 1000. KubeRay runs `ray start` in it and the RayJob's entrypoint
# (`dynrubric train openrlhf --run --in-ray-job`) on the head.
FROM rayproject/ray:2.55.0-py311-gpu AS dynrubric-train
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
USER root
WORKDIR /opt/dynrubric
COPY pyproject.toml constraints.txt README.md ./
COPY dynrubric ./dynrubric
COPY streaming ./streaming
COPY serving ./serving
RUN chown -R 1000 /opt/dynrubric
USER 1000
# openrlhf: OpenRLHF with its CUDA stack (deepspeed, vLLM); postgres: the registration of each round. Into the
# image's own Python (Ray's, owned by `ray`), where `ray start` and the job's entrypoint find it.
RUN pip install -c constraints.txt ".[openrlhf,postgres,lora]" && dynrubric --help >/dev/null
