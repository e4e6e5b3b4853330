#!/usr/bin/env bash
# Each fp8 attention kernel against its own arithmetic: first enable's check's own heads at heads of 128, with the
# offsets in Q, K and V and in each alone (which one a kernel departs on), FlashInfer's e4m3 kernel with V smoothed (as
# hookkit runs it) and as it comes; then head sizes 32-256, 68 to 8,192 tokens, Gaussian, offset and the trained tiny
# Flux's own inputs (where FlashInfer's kernel departs from what its quantization implies). hookkit_fp8 is the control.
# benchmarks/attention_own_arithmetic.py: attention_own_arithmetic_check.json and .log, attention_own_arithmetic.json
# and .log. Three or four minutes on one H200. Settings: T_OWN (seconds, 300), OWN_CHECK_ONLY (1: the check's heads
# only).
source "$(dirname "$0")/../suite_lib.sh"
rows='^(flashinfer_fp8|flashinfer_fp8_unsmoothed_v|hookkit_fp8) '
timeout "${T_OWN:-300}" python3 benchmarks/attention_own_arithmetic.py --kinds check check-q check-k check-v --dims 128 \
  --tokens 2048 8192 --out "$OUT/attention_own_arithmetic_check.json" > "$OUT/attention_own_arithmetic_check.log" 2>&1
note "own arithmetic, the check's heads, rc $?"
grep -E "$rows" "$OUT/attention_own_arithmetic_check.log" | tr -s ' ' | while read -r line; do note "$line"; done
[ "${OWN_CHECK_ONLY:-0}" = 1 ] && exit 0
timeout "${T_OWN:-300}" python3 benchmarks/attention_own_arithmetic.py --out "$OUT/attention_own_arithmetic.json" \
  > "$OUT/attention_own_arithmetic.log" 2>&1
note "own arithmetic rc $? $(grep -cE "$rows" "$OUT/attention_own_arithmetic.log") rows"
grep -E '^flashinfer_fp8' "$OUT/attention_own_arithmetic.log" | tr -s ' ' | while read -r line; do note "$line"; done
