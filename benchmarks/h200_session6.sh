#!/usr/bin/env bash
# Session 6's first H200 call (a probe, one command): what one-pass row reductions give the fp8 activation
# quantization at Flux-dev 1024²'s shapes (benchmarks/rowwise_quant.py), the same in the full step
# (step_profile.py, native+mod vs native+mod+mk), and the GPU tests of the CUDA graph code refactored after the
# last GPU run (split graphs, compile, syncs). Each piece has its own timeout; logs and JSON go to $OUT.
#   bash benchmarks/h200_session6.sh          (carry .whl)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
timeout ${T_QUANT:-120} python3 benchmarks/rowwise_quant.py --out "$OUT" > "$OUT/rowwise_quant.log" 2>&1; echo "rowwise rc $?"
grep '^{' "$OUT/rowwise_quant.log" | cut -c1-300
timeout ${T_PROFILE:-220} python3 benchmarks/step_profile.py --size 1024 --variants "${VARIANTS:-native+mod,native+mod+mk}" \
  --runs 15 --warmup 2 --out "$OUT" > "$OUT/profile.log" 2>&1; echo "profile rc $?"
grep "^\[step_profile\]" "$OUT/profile.log"; cat "$OUT/step_profile.md" 2>/dev/null
timeout ${T_TESTS:-170} python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_split_graphs.py \
  tests/test_compile.py tests/test_syncs.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
tail -15 "$OUT/gpu_tests.log"
