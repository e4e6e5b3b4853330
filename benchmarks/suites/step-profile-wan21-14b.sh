#!/usr/bin/env bash
# Where a Wan 2.1 14B call (480x832, 81 frames, 32,760 tokens, CFG) spends its time, per configuration: the kernels.
# benchmarks/profile_config.py for each of PROFILE_CONFIGS (comma-separated `hookkit bench` rows; default: stock
# regional compile, cache-dit + its fp8 + regional compile, and hookkit's uncached fp8 + regional compile with its own
# and with FlashInfer's fp8 attention), each its own process: 2 steps, 1 warm-up call, then one profiled call;
# NAME.txt per row (wall and kernel time, launches, the operators by device and by host time). What is left between
# hookkit's computed step and the peer's is read from these tables. ~10 GPU minutes on one H200 (cache-dit's compile
# ~4 of them). Settings: PROFILE_CONFIGS, T_ROW (seconds a row, 420), FRAMES (81), HEIGHT/WIDTH (480/832).
# QUICK=1: the tiny Wan on this machine's device, 5 frames, rows that run there.
source "$(dirname "$0")/../suite_lib.sh"
if [ "$QUICK" = 1 ]; then
  configs=${PROFILE_CONFIGS:-eager,hookkit-compile}
  shape=(--tiny --frames 5)
else
  configs=${PROFILE_CONFIGS:-regional-compile,cache-dit+fp8+compile,hookkit-fp8+compile+fp8-attention,\
hookkit-fp8+compile+flashinfer-fp8-attention}
  shape=(--arch wan2.1-14b --height "${HEIGHT:-480}" --width "${WIDTH:-832}" --frames "${FRAMES:-81}")
fi
for config in ${configs//,/ }; do
  timeout "${T_ROW:-420}" python3 benchmarks/profile_config.py --model wan "${shape[@]}" --steps 2 --warmup 1 \
    --rows 25 --config "$config" > "$OUT/$config.txt" 2>&1
  note "$config rc $? $(sed -n 3p "$OUT/$config.txt")"
done
