#!/usr/bin/env bash
# Quality of the compiled fp8 rows (fused, exact, unfused) on the trained tiny Flux.
# benchmarks/quality_fp8.py --only the compiled rows, bf16 reference and classifier: quality.json, .md.
# Settings: T_QUALITY (seconds, 300).
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_QUALITY:-300}" python3 benchmarks/quality_fp8.py --seeds 2 --out "$OUT" \
  --only fp8+mod,fp8+mod+compile,fp8+mod+compile-exact,fp8+mod+compile-unfused
note "quality-compiled rc $?"
