#!/usr/bin/env bash
# Where HunyuanVideo 1.5's output at 480x832x81 turns non-finite (full size, random weights, one step with CFG). First
# hookkit's fp8 attention kernel alone on the first block's own masked call, all heads in one launch then each head
# (benchmarks/masked_attention_call.py; the CPU ran head 0); then the first module and SDPA call per transformer call
# under the SDPA backends BACKENDS names ("default": torch's choice); then with the kernel on every block and step,
# which turned the output non-finite (its first non-finite call, that call's inputs, and the same call unmasked and
# over the valid prefix), eager in bf16 and with the failing bench rows' recipe (fp8 GEMMs + regional compile).
# benchmarks/first_nonfinite.py: first_nonfinite_BACKEND.json and .log, first_nonfinite_hookkit_fp8.json and .log,
# first_nonfinite_hookkit_fp8_gemms_compile.json and .log; masked_call_gpu.json and .log. ~8 GPU minutes on one H100.
# Settings: T_NONFINITE (seconds per run, 300), BACKENDS (default "default cudnn efficient"; "" runs none), RECIPES
# (the kernel's runs: default "eager gemms-compile").
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_NONFINITE:-300}" python3 benchmarks/masked_attention_call.py --device cuda \
  --out "$OUT/masked_call_gpu.json" > "$OUT/masked_call_gpu.log" 2>&1
note "masked call on the GPU rc $? $(grep -c '"nonfinite": 0,' "$OUT/masked_call_gpu.log") of 17 launches finite" \
  "(all heads at once, then each)"
for backend in ${BACKENDS-default cudnn efficient}; do
  sdpa=()
  [ "$backend" = default ] || sdpa=(--sdpa "$backend")
  timeout "${T_NONFINITE:-300}" python3 benchmarks/first_nonfinite.py --model hunyuanvideo15 --full --height 480 \
    --width 832 --frames 81 --steps 1 "${sdpa[@]}" --out "$OUT/first_nonfinite_$backend.json" \
    > "$OUT/first_nonfinite_$backend.log" 2>&1
  note "first-nonfinite $backend rc $? $(grep -E '^(output finite|\{)' "$OUT/first_nonfinite_$backend.log" | tr '\n' ' ' | cut -c1-400)"
done
for which in ${RECIPES-eager gemms-compile}; do
  recipe=""
  [ "$which" = gemms-compile ] && recipe="--fp8-gemms --compile"
  name=hookkit_fp8${recipe:+_gemms_compile}
  # shellcheck disable=SC2086  # the recipe's flags, split
  timeout "${T_NONFINITE:-300}" python3 benchmarks/first_nonfinite.py --model hunyuanvideo15 --full --height 480 \
    --width 832 --frames 81 --steps 1 --hookkit-attention hookkit_fp8 $recipe --out "$OUT/first_nonfinite_$name.json" \
    > "$OUT/first_nonfinite_$name.log" 2>&1
  note "first-nonfinite $name rc $? $(grep -E '^(output finite|kernel calls)' \
    "$OUT/first_nonfinite_$name.log" | tr '\n' ' ' | cut -c1-900)"
done
