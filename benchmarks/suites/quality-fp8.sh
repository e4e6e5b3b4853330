#!/usr/bin/env bash
# fp8 quality on the shipped trained tiny Flux against bf16 uncached.
# benchmarks/quality_fp8.py, 2 seeds: quality.json, .md.
# Settings: QUALITY_ONLY (rows, comma-separated; default all), T_QUALITY (seconds, 300); QUICK=1 runs --quick.
source "$(dirname "$0")/../suite_lib.sh"
quick=""
[ "$QUICK" = 1 ] && quick="--quick"
timeout "${T_QUALITY:-300}" python3 benchmarks/quality_fp8.py $quick --seeds 2 ${QUALITY_ONLY:+--only "$QUALITY_ONLY"} \
  --out "$OUT"
note "quality rc $?"
