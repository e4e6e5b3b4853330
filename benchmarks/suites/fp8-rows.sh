#!/usr/bin/env bash
# Compile(fuse_fp8_rows): kernel tests, the kernels alone, their arithmetic, the step per value.
# tests/test_fp8_rows.py (gpu_tests.log), benchmarks/rowwise_quant.py "exact" against "fast" (rowwise_quant.json)
# and --only-arithmetic (arithmetic/rowwise_quant.json), step_profile.py at 1024² (step_profile.json, .md).
# Settings: VARIANTS (default native+mod+nofuse,native+mod+exactq,native+mod), T_TESTS_ROWS (120), T_QUANT (120),
# T_PROFILE (330) seconds.
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_TESTS_ROWS:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_fp8_rows.py \
  > "$OUT/gpu_tests.log" 2>&1
note "fp8-rows tests rc $? $(tail -1 "$OUT/gpu_tests.log")"
timeout "${T_QUANT:-120}" python3 benchmarks/rowwise_quant.py --options base,hookkit,hookkit-fast --no-extras \
  --out "$OUT" > "$OUT/rowwise_quant.log" 2>&1
note "fp8-rows kernels rc $?"
timeout 90 python3 benchmarks/rowwise_quant.py --options '' --only-arithmetic --out "$OUT/arithmetic" \
  > "$OUT/rowwise_arithmetic.log" 2>&1
note "fp8-rows arithmetic rc $? $(grep '^{' "$OUT/rowwise_arithmetic.log" | cut -c1-160 | tr '\n' ' ')"
timeout "${T_PROFILE:-330}" python3 benchmarks/step_profile.py --size 1024 --runs 15 --warmup 2 \
  --variants "${VARIANTS:-native+mod+nofuse,native+mod+exactq,native+mod}" --out "$OUT"
note "fp8-rows step profile rc $?"
cat "$OUT/step_profile.md" 2>/dev/null
