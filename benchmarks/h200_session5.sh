#!/usr/bin/env bash
# Session 5's first H200 call: the step profile of issue 18 (where the uncached fp8 + graphs step at Flux-dev 1024²
# spends its time, per attention backend and per candidate optimization), then every GPU test (issue 14's re-run).
# Each piece has its own timeout; logs and JSON go to $OUT.
#   bash benchmarks/h200_session5.sh          (carry .whl)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
V=${VARIANTS:-native,native+mod,native+mod+fused,native+mod+cdt,_native_cudnn+mod,_native_flash+mod,flash+mod,_flash_3+mod,native+mod+autotune}
timeout ${T_PROFILE:-330} python3 benchmarks/step_profile.py --size 1024 --variants "$V" --runs 15 --warmup 2 \
  --out "$OUT" > "$OUT/profile.log" 2>&1; echo "profile rc $?"
grep "^\[step_profile\]" "$OUT/profile.log"
timeout ${T_TESTS:-230} python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/ > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
tail -25 "$OUT/gpu_tests.log"
