#!/usr/bin/env bash
# Private Rehearsal grid on a GPU machine (vLLM engine), one wall-clock-bounded chunk per call. Run by hand, never in CI:
#
#     bash benchmarks/rehearsal_grid.sh WARM_START_REF [TRAINED_REF] [rehearsal_grid.py options]   # one chunk
#     bash benchmarks/rehearsal_grid.sh --report [--json PATH] [--append-results]                    # final JSON + table
#
# Each chunk call runs as much of models x {none, parallel 2/4/8, sequential 2/4} x verifier {on, off} x
# {tau2:airline, tau2:retail (test split, all tasks), bfcl:multi_turn_base (all 200)} as fits in BUDGET seconds
# (model loading included), saves its progress after every chunk and exits 3 while work remains: call it again
# until it exits 0, then once with --report (no model; benchmarks/rehearsal_grid.py's docstring says what the
# report holds and what is skipped and why). The python process is killed at BUDGET + 45 s at the latest
# (exit 124): progress of the chunks before the one in flight is kept.
#
# Environment: PYTHON (default .venv/bin/python, with the [gpu] extra for vLLM), BUDGET (default 540 s: fits a
# 10-minute command), ENGINE (vllm | hf; default vllm), GRID_OUT (default .envace/bench/rehearsal_grid: state,
# harness cache, report), GRID_ARCHIVE_IN / GRID_ARCHIVE_OUT (a .tar.gz of GRID_OUT to unpack before the call
# / write after it, for machines that start bare every call; both may name the same file).
# Exit: 0 grid done (or report written), 3 budget reached with work left, 1 run error, 2 bad arguments, 124 killed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
BUDGET="${BUDGET:-540}"
OUT_DIR="${GRID_OUT:-.envace/bench/rehearsal_grid}"
export PYTHONUNBUFFERED=1
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}"
export HF_HUB_OFFLINE=1

if [ -n "${GRID_ARCHIVE_IN:-}" ] && [ -f "$GRID_ARCHIVE_IN" ]; then
    mkdir -p "$OUT_DIR" && tar -xzf "$GRID_ARCHIVE_IN" -C "$OUT_DIR" || { echo "cannot unpack $GRID_ARCHIVE_IN" >&2; exit 2; }
    echo "[grid] unpacked $GRID_ARCHIVE_IN into $OUT_DIR"
fi

for a in "$@"; do  # flags this script sets itself: a second copy would be refused as "given twice"
    case "$a" in
        --out|--out=*) echo "rehearsal_grid.sh: set GRID_OUT=... in the environment instead of --out" >&2; exit 2 ;;
        --engine|--engine=*) echo "rehearsal_grid.sh: set ENGINE=... in the environment instead of --engine" >&2; exit 2 ;;
        --time-budget|--time-budget=*) echo "rehearsal_grid.sh: set BUDGET=... in the environment instead of --time-budget" >&2; exit 2 ;;
        --models|--models=*) echo "rehearsal_grid.sh: give the models as WARM_START_REF [TRAINED_REF], not --models" >&2; exit 2 ;;
    esac
done

if [ "${1:-}" = "--report" ]; then
    shift
    "$PY" benchmarks/rehearsal_grid.py --report --out "$OUT_DIR" "$@"
    rc=$?
else
    WARM="${1:?usage: bash benchmarks/rehearsal_grid.sh WARM_START_REF [TRAINED_REF] [options] | --report}"
    shift
    TRAINED=()
    if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then TRAINED=(--trained "$1"); shift; fi
    timeout -k 15 "$(( ${BUDGET%.*} + 45 ))" "$PY" benchmarks/rehearsal_grid.py --models "warm_start=$WARM" \
        "${TRAINED[@]}" --engine "${ENGINE:-vllm}" --time-budget "$BUDGET" --out "$OUT_DIR" "$@"
    rc=$?
fi

if [ -n "${GRID_ARCHIVE_OUT:-}" ] && [ -d "$OUT_DIR" ]; then
    mkdir -p "$(dirname "$GRID_ARCHIVE_OUT")"
    tar -czf "$GRID_ARCHIVE_OUT.tmp" -C "$OUT_DIR" . && mv "$GRID_ARCHIVE_OUT.tmp" "$GRID_ARCHIVE_OUT" \
        && echo "[grid] state archived to $GRID_ARCHIVE_OUT ($(du -h "$GRID_ARCHIVE_OUT" | cut -f1))"
fi
exit $rc
