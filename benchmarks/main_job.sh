#!/usr/bin/env bash
# Wall time and peak RSS of the main job (README's first command), from a warm model cache.
# Usage: bash benchmarks/main_job.sh [PROFILE] [OVERRIDES]
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
log=$(mktemp)
/usr/bin/time -v .venv/bin/pyflyte run workflows/train.py train --profile "${1:-cpu-smoke}" \
    --overrides "${2:-}" > "$log.out" 2> "$log"
grep -E "World Rehearsal training|tau2-bench evaluation|\[register\]|\[validate\]|\[curate\]" -A0 "$log.out" || true
wall=$(grep "Elapsed (wall clock)" "$log" | awk '{print $NF}')
rss_kb=$(grep "Maximum resident set size" "$log" | awk '{print $NF}')
echo "main job: wall ${wall}, peak RSS $(awk "BEGIN{printf \"%.2f\", $rss_kb/1048576}") GiB (profile ${1:-cpu-smoke})"
echo "full output: $log.out"
