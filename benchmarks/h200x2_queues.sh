#!/usr/bin/env bash
# The session-2 GPU runs on an `nvidia-h200-x2` lease: two queues, one per GPU, in the background (setsid) so
# that they outlive one 10-minute device command. `start` snapshots the working tree to /tmp/hkrun/repo (later
# calls replace the tree) and launches both queues; `collect` copies logs, JSON and per-row results to $OUT.
#   bash benchmarks/h200x2_queues.sh start      # then, in each later call:
#   sleep 540; bash benchmarks/h200x2_queues.sh collect
# Every `hookkit bench` row runs in its own process; rows are written as they finish (`--out-dir`).
set -u
W=/tmp/hkrun
RUNS="--runs 3 --warmup 1 --steps 28 --full"
FLUX_1024="eager,regional-compile,hookkit-compile,hookkit-cuda-graphs,cache-dit,hookkit-cache-fast+compile,fbcache,\
hookkit-cache-fast,hookkit-fp8+compile,hookkit-all,regional-compile-ro,hookkit-compile-ro,full-compile,\
full-compile-ro,hookkit,hookkit-cache"
FLUX_512="eager,regional-compile,hookkit-compile,hookkit-cuda-graphs,cache-dit,hookkit-cache-fast+compile,fbcache,\
hookkit-cache-fast,hookkit-fp8+compile,hookkit-all,regional-compile-ro,hookkit-compile-ro,full-compile,full-compile-ro"
QWEN_1024="eager,regional-compile,hookkit-compile,hookkit-cuda-graphs,cache-dit,hookkit-cache-fast+compile,fbcache,\
hookkit-cache-fast,hookkit-fp8+compile,hookkit-all,hookkit-sync-free,regional-compile-ro,hookkit-compile-ro"

bench() {  # bench NAME MODEL SIZE CONFIGS
  python3 -m hookkit bench --model "$2" --height "$3" --width "$3" $RUNS --configs "$4" \
    --out-dir "$W/res/$1" --json "$W/res/$1.json" > "$W/res/$1.md" 2> "$W/res/$1.err"
}

queue0() {
  python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > "$W/res/gpu_tests.log" 2>&1
  python3 benchmarks/quant_flux.py \
    --variants bf16-regional,fp8-regional,fp8-regional+fused,fp8-regional+mod,fp8-regional+fused+mod \
    > "$W/res/quant.log" 2>&1
  bench qwen-1024 qwenimage 1024 "$QWEN_1024"
}

queue1() {
  bench flux-1024 flux 1024 "$FLUX_1024"
  bench flux-512 flux 512 "$FLUX_512"
}

case "${1:-}" in
start)
  rm -rf "$W"; mkdir -p "$W/res"; cp -r . "$W/repo"; cd "$W/repo" || exit 1
  export PYTHONPATH="/tmp/site:$W/repo" PYTHONUNBUFFERED=1 OUT="$W/res"
  nvidia-smi -L > "$W/res/gpus.txt"
  export W RUNS FLUX_1024 FLUX_512 QWEN_1024
  export -f bench queue0 queue1
  CUDA_VISIBLE_DEVICES=0 setsid bash -c 'queue0; echo done > "$W/res/q0.done"' > "$W/res/q0.log" 2>&1 < /dev/null &
  CUDA_VISIBLE_DEVICES=1 setsid bash -c 'queue1; echo done > "$W/res/q1.done"' > "$W/res/q1.log" 2>&1 < /dev/null &
  sleep 2; echo started; ls "$W/res"
  ;;
collect)
  cd "$W/res" || exit 1
  ls -R . | head -80
  tail -n 3 gpu_tests.log quant.log 2>/dev/null
  for f in *.md *.err; do [ -s "$f" ] && { echo "== $f"; tail -n 25 "$f"; }; done
  tar czf "$OUT/res.tgz" --exclude='*.pt' .
  ;;
*) echo "usage: $0 start|collect" >&2; exit 2 ;;
esac
