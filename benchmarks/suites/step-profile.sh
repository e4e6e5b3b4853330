#!/usr/bin/env bash
# Where the uncached fp8 + graphs step of Flux-dev 1024² spends its time, per variant.
# benchmarks/step_profile.py at 1024², 15 runs (attention backends, candidate optimizations: its --help lists the
# variants): step_profile.json, .md.
# Settings: VARIANTS (comma-separated), T_PROFILE (seconds, 330); QUICK=1 runs --quick.
source "$(dirname "$0")/../suite_lib.sh"
if [ "$QUICK" = 1 ]; then
  python3 benchmarks/step_profile.py --quick --out "$OUT"
else
  timeout "${T_PROFILE:-330}" python3 benchmarks/step_profile.py --size 1024 --runs 15 --warmup 2 --out "$OUT" \
    --variants "${VARIANTS:-native,native+mod,native+fused,_native_cudnn,_native_flash,_native_efficient,flash,_flash_3}"
fi
note "profile rc $?"
cat "$OUT/step_profile.md" 2>/dev/null
