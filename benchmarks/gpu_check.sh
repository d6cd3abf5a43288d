#!/usr/bin/env bash
# One end-to-end GRPO step with vLLM rollouts on one GPU (issue 7 item 3). Run by hand, never in CI:
#
#     bash benchmarks/gpu_check.sh /path/to/hf-model [G=8] [max_new_tokens=128] [prompts=8]
#
# Needs a CUDA machine with the [gpu] extra (vLLM). Budget: under 8 minutes on one H200 for a <= 2B model
# (the whole script is killed at 480 s). Steps, each timed:
#   1. VLLMEngine on the model (prefix caching on, LoRA serving enabled, eager mode: no compile time).
#   2. Rollouts: <prompts> tool-use prompts of ~1.5k tokens, G samples each, T=1, log-probs returned.
#   3. Log-prob agreement: vLLM's behaviour log-probs vs the trainer's teacher-forced ones (same weights).
#   4. One PolicyTrainer.update (LoRA r=16 q/v, bf16 autocast, lr 1e-3 so the change is visible).
#   5. Sync path A, LoRA serving: save the adapter, load_lora, greedy rollouts -> log-probs vs trainer.
#   6. Sync path B, merged weights: export_merged -> collective_rpc("reload_weights") -> reset_prefix_cache,
#      greedy rollouts -> log-probs vs trainer and vs path A (no engine restart).
# Prints one table. Large |diff| in rows 3/5/6 means the sync or the log-prob convention is wrong.
set -euo pipefail
MODEL="${1:?usage: bash benchmarks/gpu_check.sh /path/to/hf-model [G] [max_new_tokens] [prompts]}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}"
timeout 480 "$PY" benchmarks/gpu_check.py "$MODEL" "${2:-8}" "${3:-128}" "${4:-8}"
