#!/usr/bin/env bash
# hookkit_fp8's K channel means and V channel amax at Wan 2.1 14B's attention shape: torch's three reductions against
# fp8_triton.channel_statistics's one pass, quantize_inputs whole, and the kernel's tiling sweep.
# benchmarks/attention_input_statistics.py: attention_input_statistics.json and attention_input_statistics.log.
# ~1 GPU minute. Settings: T_AIS (seconds, 240).
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_AIS:-240}" python3 benchmarks/attention_input_statistics.py --blocks 4 8 16 32 64 \
  --programs 256 512 1024 2048 4096 --out "$OUT/attention_input_statistics.json" > "$OUT/attention_input_statistics.log" 2>&1
note "attention input statistics rc $?"
grep -E "^(torch|hookkit|quantize_inputs|\{)" "$OUT/attention_input_statistics.log" | while read -r line; do note "$line"; done
