#!/usr/bin/env bash
# The three-server benchmark on one GPU (tensor parallel 1) with a randomly initialised ~1B-parameter (0.95B)
# Llama (hidden 2048, 16 layers, 32 heads, intermediate 5632, vocab 32000, character-level tokenizer;
# built locally, no model hub). Runs in one go on a CUDA machine with the project installed with the
# `gpu` extra (CUDA vllm through ray[llm]):
#
#   python3.11 -m venv .venv && .venv/bin/pip install -e '.[gpu,dev,loadtest]'
#   loadtests/gpu_bench.sh                      # writes reports/gpu-bench-<time>/bench.{md,json,png}
#
# Knobs (environment): PYTHON, MODEL_DIR, OUT, CONCURRENCY ("1 8 32 64"), REQUESTS (per concurrency),
# PROMPT_TOKENS, OUTPUT_TOKENS, SERVERS (bare,rayllm,ours,ours-lease; add rayllm-ha,ours-ha for Ray Serve's
# HAProxy ingress mode). Each server gets the whole GPU in turn and is stopped before the next starts.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-/tmp/raystack-models/llama-1b}
OUT=${OUT:-reports/gpu-bench-$(date +%Y%m%d-%H%M%S)}
CONCURRENCY=${CONCURRENCY:-"1 8 32 64"}
REQUESTS=${REQUESTS:-400}
PROMPT_TOKENS=${PROMPT_TOKENS:-256}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
SERVERS=${SERVERS:-bare,rayllm,ours,ours-lease}

nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
if [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]; then
  echo "the GPU is in use by another process; the benchmark needs all of it" >&2
  exit 1
fi
"$PYTHON" - <<'PY'
import torch, vllm
from vllm.platforms import current_platform
assert torch.cuda.is_available(), "torch sees no GPU"
assert current_platform.is_cuda(), f"vllm {vllm.__version__} is not the CUDA build (install the gpu extra)"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" -m loadtests.models 1b --out "$MODEL_DIR"
# shellcheck disable=SC2086  # CONCURRENCY is a list
"$PYTHON" -m loadtests.bench --gpu --model-dir "$MODEL_DIR" --out "$OUT" \
  --servers "$SERVERS" --concurrency $CONCURRENCY --requests "$REQUESTS" \
  --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" \
  --max-model-len 2048 --max-num-seqs 256 --dtype bfloat16
echo "report: $OUT/bench.md"
