#!/usr/bin/env bash
# The uncached fp8 step of Qwen-Image 1024², with and without real_rope, and its prologue.
# benchmarks/step_profile.py --model qwenimage (step_profile.json, .md), then benchmarks/real_rope.py (real_rope.json).
# Settings: VARIANTS_QWEN (default native+mod,native+mod+complex), REAL_ROPE_MICRO (0 skips real_rope.py),
# T_PROFILE (seconds, 330); QUICK=1 runs --quick.
source "$(dirname "$0")/../suite_lib.sh"
args="--size 1024 --runs 15 --warmup 2"
[ "$QUICK" = 1 ] && args="--quick"
# shellcheck disable=SC2086
timeout "${T_PROFILE:-330}" python3 benchmarks/step_profile.py --model qwenimage $args \
  --variants "${VARIANTS_QWEN:-native+mod,native+mod+complex}" --out "$OUT"
note "qwen profile rc $?"
[ "${REAL_ROPE_MICRO:-1}" = 1 ] || exit 0
timeout 120 python3 benchmarks/real_rope.py --out "$OUT"
note "real_rope rc $?"
