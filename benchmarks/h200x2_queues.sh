#!/usr/bin/env bash
# GPU runs on an `nvidia-h200-x2` lease: two queues, one per GPU, in the background (setsid) so that they
# outlive one 10-minute device command. `start [main|followup]` snapshots the working tree to /tmp/hkrun/repo
# (later calls replace the tree) and launches both queues; `collect` copies logs, JSON and per-row results
# to $OUT. `main` is session 2's run (BENCHMARKS.md, run 6); `followup` the rows it left for later (run 7);
# `next` the peer comparison still to measure (below).
#   bash benchmarks/h200x2_queues.sh start main   # then, in each later call:
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

# followup: why fp8 + regional compile at 512² is slower than eager (profile, more warm-up, fp8 under each
# compile mode), the GPU tests written after run 6, the matrix rows run 6 left out (Qwen-Image full
# compile, memo and bookkeeping rows, cache-dit told the call's CFG; Flux bookkeeping rows; fp8 + graphs), and
# the DBCache "fast" rows again with the step masks that now equal cache-dit's, beside a cache-dit row.
followup0() {
  for c in hookkit-fp8+compile hookkit-compile; do
    python3 benchmarks/profile_config.py --model flux --size 512 --config "$c" --warmup 3 > "$W/res/profile-$c.log" 2>&1
  done
  RUNS="--runs 5 --warmup 2 --steps 28 --full" bench flux-512-more flux 512 \
    "eager,regional-compile,hookkit-compile,hookkit-fp8+compile,hookkit-fp8+cuda-graphs,hookkit-cuda-graphs,\
hookkit,hookkit-cache,hookkit-memo,hookkit-sync-free,hookkit-cache-fast,hookkit-cache-fast+compile"
  bench flux-1024-more flux 1024 \
    "eager,hookkit-fp8+cuda-graphs,hookkit-memo,hookkit-sync-free,cache-dit,hookkit-cache-fast,hookkit-cache-fast+compile"
}

followup1() {
  python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > "$W/res/gpu_tests.log" 2>&1
  python3 benchmarks/quant_flux.py --size 512 --variants bf16-regional,fp8-regional,fp8-ro,fp8-graph \
    > "$W/res/quant512.log" 2>&1
  bench qwen-1024-more qwenimage 1024 \
    "eager,cache-dit,hookkit-cache-fast,hookkit-cache-fast+compile,hookkit,hookkit-cache,hookkit-memo,\
hookkit-fp8+cuda-graphs,full-compile,full-compile-ro"
}

# next: the peer's fastest configuration side by side with hookkit's (cache-dit + regional compile was only
# measured in DESIGN.md), and the fastest hookkit row on Qwen-Image.
PEERS="eager,cache-dit,cache-dit+compile,hookkit-cache-fast+compile,hookkit-fp8+cache-fast+cuda-graphs"
next0() { bench flux-1024-peers flux 1024 "$PEERS"; bench flux-512-peers flux 512 "$PEERS"; }
next1() { python3 -m pytest -m gpu tests/ -q -p no:cacheprovider > "$W/res/gpu_tests.log" 2>&1
  bench qwen-1024-peers qwenimage 1024 "$PEERS"; }

case "${1:-}" in
start)
  rm -rf "$W"; mkdir -p "$W/res"; cp -r . "$W/repo"; cd "$W/repo" || exit 1
  export PYTHONPATH="/tmp/site:$W/repo" PYTHONUNBUFFERED=1 OUT="$W/res"
  nvidia-smi -L > "$W/res/gpus.txt"
  export W RUNS FLUX_1024 FLUX_512 QWEN_1024 PEERS
  export -f bench queue0 queue1 followup0 followup1 next0 next1
  case "${2:-main}" in
    main) q0=queue0 q1=queue1 ;;
    followup) q0=followup0 q1=followup1 ;;
    next) q0=next0 q1=next1 ;;
    *) echo "unknown run ${2}; expected main, followup or next" >&2; exit 2 ;;
  esac
  CUDA_VISIBLE_DEVICES=0 setsid bash -c "$q0; echo done > \"\$W/res/q0.done\"" > "$W/res/q0.log" 2>&1 < /dev/null &
  CUDA_VISIBLE_DEVICES=1 setsid bash -c "$q1; echo done > \"\$W/res/q1.done\"" > "$W/res/q1.log" 2>&1 < /dev/null &
  sleep 2; echo started; ls "$W/res"
  ;;
collect)
  cd "$W/res" || exit 1
  ls -R . | head -80
  tail -n 3 gpu_tests.log quant.log quant512.log profile-*.log 2>/dev/null
  for f in *.md *.err; do [ -s "$f" ] && { echo "== $f"; tail -n 25 "$f"; }; done
  tar czf "$OUT/res.tgz" --exclude='*.pt' .
  ;;
*) echo "usage: $0 start [main|followup|next] | collect" >&2; exit 2 ;;
esac
