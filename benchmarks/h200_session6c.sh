#!/usr/bin/env bash
# Session 6's third H200 call: the one-pass kernel rewritten to hold rows in chunks of the input dtype (the first
# version spilled registers), measured in isolation, tested, and in the uncached fp8 + graphs step.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${T_QUANT:-60} python3 benchmarks/rowwise_quant.py --options hookkit --no-extras --out "$OUT" > "$OUT/rowwise_quant.log" 2>&1
echo "rowwise rc $?"; grep '^{' "$OUT/rowwise_quant.log" | cut -c1-200; grep -m1 -A12 Traceback "$OUT/rowwise_quant.log" | tail -6
timeout ${T_TESTS:-75} python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_fp8_rows.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc $?"; grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.log" | head -8
timeout ${T_PROFILE:-140} python3 benchmarks/step_profile.py --size 1024 --variants native+mod --runs 15 --warmup 2 \
  --out "$OUT" > "$OUT/profile.log" 2>&1; echo "profile rc $?"
grep "^\[step_profile\]" "$OUT/profile.log"; python3 -c "
import json; d=json.load(open('$OUT/step_profile.json'))
for r in d['rows']:
    print(r['variant'], r.get('step_ms'), r.get('kernel_ms'), r.get('groups_ms'), r.get('fp8_rows_fused'))
    for k in r.get('top_kernels', [])[:6]: print('  %.2f x%.0f %s' % (k['ms'], k['count'], k['name'][:90]))" 2>&1 | tail -9
