#!/usr/bin/env bash
# Session 4's last H200 call: every GPU test, then issue 15's pipelines (quick), issue 17's one-GPU dry run of the
# context-parallel script, and the CUDA-graph model watch's cost on the GPU host. Each piece has its own timeout so
# one slow piece cannot take the others' time; logs and JSON go to $OUT (at most 8 files come back).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${T_TESTS:-170} python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
tail -3 "$OUT/gpu_tests.log"
mkdir -p /tmp/p
for part in resolutions controlnet wan22; do
  OUT=/tmp/p/$part timeout ${T_PART:-75} python3 benchmarks/pipelines.py --quick --parts $part > "/tmp/p/$part.log" 2>&1
  echo "pipelines $part rc $?"; cp /tmp/p/$part/pipelines.json "$OUT/pipelines_$part.json" 2>/dev/null
done
tail -n 5 /tmp/p/*.log > "$OUT/pipelines.log"
OUT=$OUT timeout ${T_CP:-80} python3 benchmarks/context_parallel.py --dry-run --quick > "$OUT/cp_dry_run.log" 2>&1; echo "cp dry run rc $?"
OUT=$OUT timeout ${T_WATCH:-40} python3 benchmarks/watch_overhead.py --quick > "$OUT/watch.log" 2>&1; echo "watch rc $?"
ls "$OUT"
