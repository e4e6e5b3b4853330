#!/usr/bin/env bash
# Context parallelism (Ulysses) over every visible GPU: tests, cases, generate, bench.
# Needs 2 or more GPUs (nvidia-h200-x2): tests/test_parallel.py, benchmarks/context_parallel.py per case (CASE.log
# and its JSON), `hookkit generate --parallel` (generate.log) and `hookkit bench --parallel` (bench-cp.md, .json).
# Settings: NPROC (processes, default: the visible GPUs), CP_CASES (default "quick flux-1024 qwen-1024 flux-2048").
source "$(dirname "$0")/../suite_lib.sh"
nproc=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$nproc" -ge 2 ] || { note "context-parallel needs 2 or more GPUs; $nproc visible"; exit 1; }
python3 -m pytest -m gpu tests/test_parallel.py -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
note "parallel tests rc $? $(tail -1 "$OUT/gpu_tests.log")"
for case in ${CP_CASES:-quick flux-1024 qwen-1024 flux-2048}; do
  case "$case" in
    quick) args="--quick" ;;
    flux-2048) args="--cases flux-2048 --runs 2 --warmup 1" ;;
    *) args="--cases $case" ;;
  esac
  # shellcheck disable=SC2086
  torchrun --nproc_per_node "$nproc" benchmarks/context_parallel.py $args > "$OUT/$case.log" 2>&1
  note "context_parallel.py $case rc $?"
done
torchrun --nproc_per_node "$nproc" -m hookkit generate flux --full --parallel "ulysses=$nproc" --cache \
  --cache-mask fast --cache-mode static --compile --summary --out "$OUT/flux-cp.pt" > "$OUT/generate.log" 2>&1
note "generate rc $?"
rm -f "$OUT/flux-cp.pt"
torchrun --nproc_per_node "$nproc" -m hookkit bench --full --parallel "ulysses=$nproc" --runs 3 --warmup 1 \
  --configs eager,hookkit-compile,hookkit-cache-fast+compile,hookkit-fp8+compile \
  --json "$OUT/bench-cp.json" > "$OUT/bench-cp.md" 2> "$OUT/bench-cp.err"
note "bench rc $?"
cat "$OUT/bench-cp.md"
