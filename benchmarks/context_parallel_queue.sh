#!/usr/bin/env bash
# Issue 17's 2-GPU context-parallel runs on an `nvidia-h200-x2` lease, in the background (setsid) so that they
# outlive one 10-minute device command. `start` snapshots the working tree to /tmp/hkcp/repo and runs the queue
# below (one torchrun per selection, both GPUs); `collect` prints the logs' tails and tars the JSON into $OUT.
#   bash benchmarks/context_parallel_queue.sh start      # then, in each later call:
#   sleep 540; bash benchmarks/context_parallel_queue.sh collect
# Wheels (diffusers 0.42.1, torchao 0.17, loguru, importlib_metadata, cache-dit) unpacked into /tmp/site first.
set -u
W=/tmp/hkcp
cp_run() {  # cp_run NAME ARGS...: one torchrun of benchmarks/context_parallel.py
  local name=$1; shift
  torchrun --nproc_per_node 2 benchmarks/context_parallel.py "$@" > "$W/res/$name.log" 2>&1
}
queue() {
  python3 -m pytest -m gpu tests/test_parallel.py -q -p no:cacheprovider > "$W/res/gpu_tests.log" 2>&1
  cp_run quick --quick
  cp_run flux-1024 --cases flux-1024
  cp_run qwen-1024 --cases qwen-1024
  cp_run flux-2048 --cases flux-2048 --runs 2 --warmup 1
  torchrun --nproc_per_node 2 -m hookkit generate flux --full --parallel ulysses=2 --cache --cache-mask fast \
    --cache-mode static --compile --summary --out "$W/res/flux-cp.pt" > "$W/res/generate.log" 2>&1
  torchrun --nproc_per_node 2 -m hookkit bench --full --parallel ulysses=2 --runs 3 --warmup 1 \
    --configs eager,hookkit-compile,hookkit-cache-fast+compile,hookkit-fp8+compile \
    --json "$W/res/bench-cp.json" > "$W/res/bench-cp.md" 2> "$W/res/bench-cp.err"
}
case "${1:-}" in
start)
  rm -rf "$W"; mkdir -p "$W/res"; cp -r . "$W/repo"; cd "$W/repo" || exit 1
  export PYTHONPATH="/tmp/site:$W/repo" PYTHONUNBUFFERED=1 OUT="$W/res" W
  export -f cp_run queue
  nvidia-smi -L > "$W/res/gpus.txt"
  setsid bash -c "queue; echo done > \"\$W/res/queue.done\"" > "$W/res/queue.log" 2>&1 < /dev/null &
  sleep 2; echo started
  ;;
collect)
  cd "$W/res" || exit 1
  ls -l
  for f in *.log *.md *.err; do [ -s "$f" ] && { echo "== $f"; tail -n 20 "$f"; }; done
  tar czf "$OUT/cp-res.tgz" --exclude='*.pt' .
  ;;
*) echo "usage: $0 start | collect" >&2; exit 2 ;;
esac
