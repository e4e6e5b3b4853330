#!/usr/bin/env bash
# The fp8 per-row activation quantization at Flux-dev 1024²'s shapes, alone, per option.
# benchmarks/rowwise_quant.py: rowwise_quant.json. Settings: QOPTIONS (--options; default '': only the
# hand-written Triton and copy rows; e.g. base,hookkit,hookkit-fast), QUANT_ARGS (more options, e.g. --no-extras),
# T_QUANT (seconds, 120).
source "$(dirname "$0")/../suite_lib.sh"
# shellcheck disable=SC2086
timeout "${T_QUANT:-120}" python3 benchmarks/rowwise_quant.py --options "${QOPTIONS-}" ${QUANT_ARGS:-} \
  --out "$OUT" > "$OUT/rowwise_quant.log" 2>&1
note "rowwise quant rc $?"
grep '^{' "$OUT/rowwise_quant.log" | cut -c1-300
