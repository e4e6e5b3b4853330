#!/usr/bin/env bash
# Session 6's last H200 call: hookkit's one-pass fp8 row quantization (Compile(fuse_fp8_rows=True)) checked and
# measured: its GPU tests, the uncached fp8 + graphs step with and without it (step_profile.py), the fastest Flux-dev
# 1024² row with it (the row of run 12 ran without it), its quality on the trained tiny model, and the
# micro-benchmark rows. Each piece has its own timeout; logs and JSON go to $OUT.
#   bash benchmarks/h200_session6b.sh          (carry .whl)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${T_TESTS:-110} python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_fp8_rows.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc $?"; grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.log" | head -12
timeout ${T_PROFILE:-170} python3 benchmarks/step_profile.py --size 1024 --variants "${VARIANTS:-native+mod+nofuse,native+mod}" \
  --runs 15 --warmup 2 --out "$OUT" > "$OUT/profile.log" 2>&1; echo "profile rc $?"
grep "^\[step_profile\]" "$OUT/profile.log"; cat "$OUT/step_profile.md" 2>/dev/null; grep -m3 -B2 -A8 "Traceback" "$OUT/profile.log" | tail -12
C=hookkit-fp8-mod+cache-fast+cuda-graphs
timeout ${T_ROW:-110} python3 -m hookkit bench-one --config $C --model flux --runs 3 --warmup 1 --steps 28 --full \
  --height 1024 --width 1024 --out-dir "$OUT" --result "$OUT/flux1024_fused.json" > /dev/null 2> "$OUT/row.err"
echo "row rc $?"; rm -f "$OUT"/*.pt
python3 -c "import json; r=json.load(open('$OUT/flux1024_fused.json')); print({k: r.get(k) for k in ('status','latency_s','latencies_s','peak_memory_gb','note')})" 2>&1 | tail -2
timeout ${T_QUALITY:-120} python3 benchmarks/quality_fp8.py --seeds 2 --only fp8+mod,fp8+mod+compile,fp8+mod+compile-unfused \
  --out "$OUT/quality_fp8" > "$OUT/quality.log" 2>&1; echo "quality rc $?"; grep "^| fp8\|^| reference" "$OUT/quality.log"
timeout ${T_QUANT:-60} python3 benchmarks/rowwise_quant.py --options base,hookkit --out "$OUT" > "$OUT/rowwise_quant.log" 2>&1
echo "rowwise rc $?"; grep '^{' "$OUT/rowwise_quant.log" | head -6 | cut -c1-240
