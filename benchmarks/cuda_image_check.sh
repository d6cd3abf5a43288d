#!/usr/bin/env bash
# Installs the CUDA images' packages together (containers/train-cuda.Dockerfile, then eval-cuda.Dockerfile's
# layer on top, with uv 0.5.1 as they use it) into a venv outside the repository and imports them, without a
# GPU. Run by hand, never in CI: it downloads a few GB (torch's CUDA libraries, vLLM) from the package index.
#
#     bash benchmarks/cuda_image_check.sh [VENV, default /tmp/envace-cuda-venv] [--keep-cache]
#
# The venv is replaced if it exists; uv and the image's /root copy go to VENV-tools/ (uv's download cache
# too, removed at the end unless --keep-cache). Writes benchmarks/results/cuda_images.json; exit status 1
# when an install, an import or `pip check` fails. Details: benchmarks/cuda_image_check.py's docstring.
set -euo pipefail
cd "$(dirname "$0")/.."
exec nice -n 10 python3 benchmarks/cuda_image_check.py "$@"
