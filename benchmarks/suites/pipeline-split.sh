#!/usr/bin/env bash
# Where a pipeline call's time goes: wall, GPU-only, kernels and host per call.
# benchmarks/pipeline_split.py for each "model:config" of SPLIT: split_MODEL.log and the script's JSON.
# Settings: SPLIT (default "flux:hookkit-fp8-mod+cuda-graphs qwenimage:hookkit-fp8-mod+cache-fast+cuda-graphs"),
# T_SPLIT (seconds per pair, 240).
source "$(dirname "$0")/../suite_lib.sh"
for mc in ${SPLIT:-flux:hookkit-fp8-mod+cuda-graphs qwenimage:hookkit-fp8-mod+cache-fast+cuda-graphs}; do
  timeout "${T_SPLIT:-240}" python3 benchmarks/pipeline_split.py --model "${mc%%:*}" --config "${mc#*:}" \
    --out "$OUT" > "$OUT/split_${mc%%:*}.log"
  note "split $mc rc $? $(tail -1 "$OUT/split_${mc%%:*}.log")"
done
