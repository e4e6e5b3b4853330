#!/usr/bin/env bash
# Session 6's last minutes on the H200: Compile(fuse_fp8_rows="fast") measured in isolation against "exact", its
# kernel test, then the step. Streams to $OUT (what finishes before the budget ends comes back).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 50 python3 benchmarks/rowwise_quant.py --options hookkit-fast,hookkit --no-extras --out "$OUT" > "$OUT/rowwise_quant.log" 2>&1
echo "rowwise rc $?"; grep '^{' "$OUT/rowwise_quant.log" | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/rowwise_quant.json'))
for r in d['rows']: print(r['pattern'], r['variant'], [(k['name'][:30], round(k['ms'], 4)) for k in r.get('kernels', [])[:2]])"
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_fp8_rows.py -k "fast_kernel or without_gelu" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc $?"; grep -E "passed|failed|^E " "$OUT/gpu_tests.log" | head -6
timeout 120 python3 benchmarks/step_profile.py --size 1024 --variants native+mod+fastq --runs 15 --warmup 2 \
  --out "$OUT" > "$OUT/profile.log" 2>&1; echo "profile rc $?"; grep "^\[step_profile\]" "$OUT/profile.log"; cat "$OUT/step_profile.md" 2>/dev/null
