#!/usr/bin/env bash
# Where HunyuanVideo 1.5's eager output at 480x832x81 turns non-finite (full size, random weights, one step): the
# first module and SDPA call per transformer call, under torch's SDPA choice and pinned to cuDNN and the efficient
# kernel; then with hookkit's fp8 attention kernel on every block, which turned the output non-finite (its first
# non-finite call, that call's inputs, and the same call unmasked and over the valid prefix); then the kernel alone on
# the first block's own masked call, every head (benchmarks/masked_attention_call.py, which the CPU ran on head 0).
# benchmarks/first_nonfinite.py: first_nonfinite_BACKEND.json and .log, first_nonfinite_hookkit_fp8.json and .log;
# masked_call_gpu.json and .log. ~6 GPU minutes on one H100.
# Settings: T_NONFINITE (seconds per run, 240).
source "$(dirname "$0")/../suite_lib.sh"
for backend in default cudnn efficient; do
  sdpa=()
  [ "$backend" = default ] || sdpa=(--sdpa "$backend")
  timeout "${T_NONFINITE:-240}" python3 benchmarks/first_nonfinite.py --model hunyuanvideo15 --full --height 480 \
    --width 832 --frames 81 --steps 1 "${sdpa[@]}" --out "$OUT/first_nonfinite_$backend.json" \
    > "$OUT/first_nonfinite_$backend.log" 2>&1
  note "first-nonfinite $backend rc $? $(grep -E '^(output finite|\{)' "$OUT/first_nonfinite_$backend.log" | tr '\n' ' ' | cut -c1-400)"
done
timeout "${T_NONFINITE:-240}" python3 benchmarks/first_nonfinite.py --model hunyuanvideo15 --full --height 480 \
  --width 832 --frames 81 --steps 1 --hookkit-attention hookkit_fp8 --out "$OUT/first_nonfinite_hookkit_fp8.json" \
  > "$OUT/first_nonfinite_hookkit_fp8.log" 2>&1
note "first-nonfinite hookkit_fp8 rc $? $(grep -E '^(output finite|kernel calls)' \
  "$OUT/first_nonfinite_hookkit_fp8.log" | tr '\n' ' ' | cut -c1-600)"
timeout "${T_NONFINITE:-240}" python3 benchmarks/masked_attention_call.py --device cuda \
  --out "$OUT/masked_call_gpu.json" > "$OUT/masked_call_gpu.log" 2>&1
note "masked call on the GPU rc $? $(grep -c '"nonfinite": 0,' "$OUT/masked_call_gpu.log") of 16 heads finite"
