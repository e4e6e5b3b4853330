#!/usr/bin/env bash
# Issue 18 on ONE H200 lease (nvidia-h200): hookkit's fastest rows beside the strongest peer
# (cache-dit + its fp8 per-row + regional compile), side by side, medians after warm-up with their spread.
# One background queue (setsid), so that it outlives a 10-minute device command; a later call collects.
#
#   call 1:  bash benchmarks/h200_issue18.sh start && sleep 540 && bash benchmarks/h200_issue18.sh status
#   call 2:  bash benchmarks/h200_issue18.sh collect 300      # waits up to 300 s for the queue, then collects
#   CPU:     bash benchmarks/h200_issue18.sh quick            # every piece, tiny models, synchronously (~6 min)
#
# `start` snapshots the working tree to /tmp/hk18/repo and installs the wheels of $WHL (default .whl: carry
# it) into /tmp/site when diffusers/torchao/loguru/cache_dit do not import. Pieces, in this order (each
# streams its results; expected wall time on an H200, first calls included):
#   gpu-check   GPU test of dynamic DBCache under split graphs (trained tiny Flux) + fp8 quality  ~1.5 min
#   flux-1024   Flux-dev 1024², fresh compiler caches per row (--cold: first call, time to first image):
#               hookkit fastest, + modulation fp8, cache-dit+fp8+compile                           ~6 min
#   flux-512    Flux-dev 512²: fastest, dynamic DBCache under split graphs, + modulation, the peer  ~5 min
#   profile     step profile, Flux 1024² uncached fp8 + graphs, per attention backend              ~2.5 min
#   qwen-profile  the same for Qwen-Image 1024², fp8 incl. modulation, with/without real_rope (VARIANTS_QWEN),
#                 and benchmarks/real_rope.py (its query/key prologue alone)                     ~3 min
#   ------ ~15 min: what one 15-device-minute budget covers; the rest runs if the lease lasts ------
#   qwen-1024   Qwen-Image 1024²: fastest, + modulation fp8 (6.8 GB less), the peer                ~7 min
#   flux-256    Flux-dev 256²: fastest, + modulation, the peer                                     ~4 min
# PIECES="flux-1024 profile" bash benchmarks/h200_issue18.sh start   runs only those, in that order.
# More pieces: gpu-tests (every `-m gpu` test of GPU_TESTS, default tests/; 27 of 29 took 230 s in run 10), controlnet (benchmarks/pipelines.py --parts controlnet),
# norm-rope-micro (benchmarks/norm_rope.py; T_NR), flux-1024-warm (no fresh caches), autotune-if-faster (after profile), quant-micro (benchmarks/rowwise_quant.py; QOPTIONS),
# split (benchmarks/pipeline_split.py for each "model:config" of SPLIT; T_SPLIT), wan22 and resolutions (issue 15's benchmarks/pipelines.py parts; RES_STEPS, default 8), fp8-rows (Compile(fuse_fp8_rows):
# GPU tests, kernels alone, the step per value), quality-compiled (quality_fp8.py's compiled rows); row lists per piece: P1024, P512, P256, PQWEN; profile variants: VARIANTS.
# Every row is its own `hookkit bench-one` process (no eager reference row: these are side-by-side timings;
# quality comes from the trained tiny model). $OUT gets at most 6 files: peer_goals.md, peer_goals.json,
# step_profile.json, quality.json, queue.log and res.tgz (every row JSON and stderr log).
set -u
W=${W:-/tmp/hk18}
RUNS=${RUNS:-"--runs 3 --warmup 1 --steps 28"}
ALL="gpu-check flux-1024 flux-512 profile qwen-1024 flux-256"
PIECES=${PIECES:-$ALL}
FAST=${FAST-hookkit-fp8+cache-fast+cuda-graphs}
MOD=${MOD-hookkit-fp8-mod+cache-fast+cuda-graphs}
DYN=${DYN-hookkit-fp8+cache-dyn+cuda-graphs}
PEER=${PEER-cache-dit+fp8+compile}
AUTOTUNE=${AUTOTUNE:-hookkit-fp8-mod+cache-fast+cuda-graphs+autotune}

log() { echo "[$(date -u +%H:%M:%S)] $*" >> "$W/res/queue.log"; }

row() {  # row GROUP MODEL SIZE CONFIG COLD   (one process; fresh compiler caches when COLD=1)
  local dir="$W/res/$1" size_args="--full --height $3 --width $3"
  mkdir -p "$dir"
  [ "${QUICK:-0}" = 1 ] && size_args="--steps 6"
  log "row $1 $4 start"
  if [ "$5" = 1 ]; then
    local caches; caches=$(mktemp -d)
    mkdir -p "$caches/inductor" "$caches/triton"
    TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" HOOKKIT_BENCH_COLD=1 \
      timeout "${ROW_TIMEOUT:-900}" python3 -m hookkit bench-one --config "$4" --model "$2" $RUNS $size_args \
      --out-dir "$dir" --result "$dir/$4.json" > /dev/null 2> "$dir/$4.err"
    rc=$?
    rm -rf "$caches"
  else
    timeout "${ROW_TIMEOUT:-900}" python3 -m hookkit bench-one --config "$4" --model "$2" $RUNS $size_args \
      --out-dir "$dir" --result "$dir/$4.json" > /dev/null 2> "$dir/$4.err"
    rc=$?
  fi
  rm -f "$dir/$4.pt"
  log "row $1 $4 exit $rc $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['status'], r['latency_s'], r['note'][:100])" "$dir/$4.json" 2>/dev/null)"
}

piece() {
  local cpu_note=""
  [ "${QUICK:-0}" = 1 ] && cpu_note="--quick"
  case "$1" in
    gpu-check)
      python3 -m pytest -q -p no:cacheprovider tests/test_split_graphs.py > "$W/res/gpu_tests.log" 2>&1
      python3 benchmarks/quality_fp8.py $cpu_note --seeds 2 --out "$W/res/quality_fp8" > "$W/res/quality.log" 2>&1
      python3 benchmarks/held_memory.py --out "$W/res" > "$W/res/held_memory.log" 2>&1 ;;
    flux-1024) for c in $FAST $MOD $PEER; do row flux-1024-cold flux 1024 "$c" 1; done ;;
    flux-1024-warm) for c in ${P1024:-$FAST $MOD}; do row flux-1024 flux 1024 "$c" 0; done ;;
    flux-512) for c in ${P512:-$FAST $DYN $MOD $PEER}; do row flux-512 flux 512 "$c" 0; done ;;
    autotune-if-faster)  # the autotuned row at 1024² only when the step profile shows it >= 2 % faster per step
      if python3 -c 'import json, sys
rows = {r["variant"]: r for r in json.load(open(sys.argv[1]))["rows"] if r.get("status") == "ok"}
a, b = rows.get("native+mod+autotune"), rows.get("native+mod")
sys.exit(0 if a and b and a["step_ms"] <= 0.98 * b["step_ms"] else 1)' "$W/res/step_profile.json"; then
        row flux-1024 flux 1024 "$AUTOTUNE" 0
      else log "autotune row skipped: not >= 2 % faster per step in the step profile (or not profiled)"; fi ;;
    gpu-tests)
      timeout "${T_TESTS:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=30 -o faulthandler_timeout=150 ${GPU_TESTS:-tests/} > "$W/res/gpu_tests_all.log" 2>&1
      log "gpu tests rc $? $(tail -1 "$W/res/gpu_tests_all.log")" ;;
    controlnet)
      OUT="$W/res/controlnet" timeout "${T_CN:-240}" python3 benchmarks/pipelines.py --parts controlnet \
        > "$W/res/controlnet.log" 2>&1
      log "controlnet rc $?" ;;
    fp8-rows)  # Compile(fuse_fp8_rows): kernel tests, the kernels alone ("exact" vs "fast"), the step with each value
      timeout "${T_TESTS_ROWS:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_fp8_rows.py \
        > "$W/res/gpu_tests_fp8_rows.log" 2>&1
      log "fp8-rows tests rc $? $(tail -1 "$W/res/gpu_tests_fp8_rows.log")"
      timeout "${T_QUANT:-120}" python3 benchmarks/rowwise_quant.py --options base,hookkit,hookkit-fast --no-extras \
        --out "$W/res" > "$W/res/rowwise_quant.log" 2>&1
      log "fp8-rows micro rc $?"
      timeout 90 python3 benchmarks/rowwise_quant.py --options '' --only-arithmetic --out "$W/res/arithmetic" \
        > "$W/res/rowwise_arithmetic.log" 2>&1
      log "fp8-rows arithmetic rc $? $(grep '^{' "$W/res/rowwise_arithmetic.log" | cut -c1-160 | tr '\n' ' ')"
      timeout "${T_PROFILE:-330}" python3 benchmarks/step_profile.py --size 1024 --runs 15 --warmup 2 \
        --variants "${VARIANTS:-native+mod+nofuse,native+mod+exactq,native+mod}" --out "$W/res" > "$W/res/profile.log" 2>&1
      log "fp8-rows profile rc $? $(grep '^\[step_profile\]' "$W/res/profile.log" | tr '\n' ' ')" ;;
    split)  # benchmarks/pipeline_split.py per "model:config" of SPLIT: wall, GPU-only, kernels and host per call
      for mc in ${SPLIT:-flux:hookkit-fp8-mod+cuda-graphs qwenimage:hookkit-fp8-mod+cache-fast+cuda-graphs}; do
        timeout "${T_SPLIT:-240}" python3 benchmarks/pipeline_split.py --model "${mc%%:*}" --config "${mc#*:}" \
          --out "$W/res/split" > "$W/res/split_${mc%%:*}.log" 2>> "$W/res/split.err"
        log "split $mc rc $? $(tail -1 "$W/res/split_${mc%%:*}.log")"
      done ;;
    quality-compiled)  # the compiled fp8 rows on the trained tiny model (bf16 reference, classifier)
      timeout "${T_QUALITY:-300}" python3 benchmarks/quality_fp8.py --seeds 2 --out "$W/res/quality_fp8" \
        --only fp8+mod,fp8+mod+compile,fp8+mod+compile-exact,fp8+mod+compile-unfused > "$W/res/quality.log" 2>&1
      log "quality-compiled rc $?" ;;
    norm-rope-micro)  # benchmarks/norm_rope.py: the q/k RMSNorm+RoPE kernel's variants vs inductor, the AdaLN rounding
      timeout "${T_NR:-300}" python3 benchmarks/norm_rope.py --out "$W/res/norm_rope" > "$W/res/norm_rope.log" 2>&1
      log "norm-rope-micro rc $?" ;;
    quant-micro)
      timeout "${T_QUANT:-120}" python3 benchmarks/rowwise_quant.py --options "${QOPTIONS-}" --out "$W/res" \
        > "$W/res/rowwise_quant.log" 2>&1
      log "quant-micro rc $?" ;;
    wan22|resolutions)  # issue 15: Wan 2.2's two experts (480x832, 5 frames); regional compile over 5 resolutions
      local pargs="--runs 2"
      [ "$1" = resolutions ] && pargs="--runs 2 --steps ${RES_STEPS:-8}"
      OUT="$W/res/$1" timeout "${T_PIPE:-330}" python3 benchmarks/pipelines.py --parts "$1" $pargs > "$W/res/$1.log" 2>&1
      log "$1 rc $? $(tail -c 300 "$W/res/$1.log" | tr '\n' ' ')" ;;
    profile)
      if [ "${QUICK:-0}" = 1 ]; then python3 benchmarks/step_profile.py --quick --out "$W/res" > "$W/res/profile.log" 2>&1
      else timeout "${T_PROFILE:-330}" python3 benchmarks/step_profile.py --size 1024 --runs 15 --warmup 2 \
             --variants "${VARIANTS:-native,native+mod,native+fused,_native_cudnn,_native_flash,_native_efficient,flash,_flash_3}" \
             --out "$W/res" > "$W/res/profile.log" 2>&1; fi ;;
    qwen-profile)
      local qargs="--size 1024 --runs 15 --warmup 2"
      [ "${QUICK:-0}" = 1 ] && qargs="--quick"
      timeout "${T_PROFILE:-330}" python3 benchmarks/step_profile.py --model qwenimage $qargs \
        --variants "${VARIANTS_QWEN:-native+mod,native+mod+complex}" --out "$W/res/qwen_profile" > "$W/res/qwen_profile.log" 2>&1
      log "qwen-profile rc $? $(grep '^\[step_profile\]' "$W/res/qwen_profile.log" | tr '\n' ' ')"
      [ "${REAL_ROPE_MICRO:-1}" = 1 ] || return 0
      timeout 120 python3 benchmarks/real_rope.py --out "$W/res/qwen_profile" > "$W/res/real_rope.log" 2>&1
      log "real_rope rc $? $(grep '^speed-up' "$W/res/real_rope.log")" ;;
    qwen-1024) for c in ${PQWEN:-$FAST $MOD $PEER}; do row qwen-1024 qwenimage 1024 "$c" 0; done ;;
    flux-256) for c in ${P256:-$FAST $MOD $PEER}; do row flux-256 flux 256 "$c" 0; done ;;
    *) log "unknown piece $1" ;;
  esac
}

queue() {
  for p in $PIECES; do log "piece $p start"; piece "$p"; log "piece $p done"; done
  echo done > "$W/res/queue.done"
}

report() { python3 benchmarks/peer_goals_report.py "$W/res" --out "$W/res" > /dev/null 2> "$W/res/report.err"; }  # FAST.. from env

ensure_packages() {
  python3 -c "import diffusers, torchao, loguru, cache_dit" 2>/dev/null && return 0
  local whl=${WHL:-.whl}
  [ -d "$whl" ] || { echo "no $whl folder and diffusers/torchao/loguru/cache_dit do not all import" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$whl"/*.whl
}

case "${1:-}" in
start)
  rm -rf "$W"; mkdir -p "$W/res"; cp -r . "$W/repo"; cd "$W/repo" || exit 1
  export PYTHONPATH="/tmp/site:$W/repo" PYTHONUNBUFFERED=1
  ensure_packages || exit 1
  nvidia-smi -L > "$W/res/gpus.txt" 2>&1
  export W RUNS PIECES GPU_TESTS SPLIT T_SPLIT T_NR REAL_ROPE_MICRO FAST MOD DYN PEER AUTOTUNE P1024 P512 P256 PQWEN VARIANTS VARIANTS_QWEN T_TESTS T_CN T_PROFILE T_QUANT QOPTIONS T_PIPE RES_STEPS T_TESTS_ROWS T_QUALITY
  export -f log row piece queue report
  setsid bash -c 'queue; report' > "$W/res/queue.out" 2>&1 < /dev/null &
  sleep 2; echo "started: $PIECES"; cat "$W/res/queue.log" 2>/dev/null
  ;;
status)
  cat "$W/res/queue.log"; ls "$W/res"
  ;;
collect)
  for _ in $(seq 1 "${2:-0}"); do [ -f "$W/res/queue.done" ] && break; sleep 1; done
  cd "$W/repo" || exit 1
  export PYTHONPATH="/tmp/site:$W/repo"
  [ -f "$W/res/queue.done" ] || echo "queue still running: collecting what has finished" | tee -a "$W/res/queue.log"
  report
  out=${OUT:-out}; mkdir -p "$out"
  cp "$W/res/peer_goals.md" "$W/res/peer_goals.json" "$W/res/queue.log" "$out/" 2>/dev/null
  cp "$W/res/step_profile.json" "$W/res/step_profile.md" "$W/res/gpu_tests_fp8_rows.log" "$out/" 2>/dev/null
  cp "$W/res/qwen_profile/step_profile.json" "$out/qwen_step_profile.json" 2>/dev/null
  cp "$W/res/qwen_profile/real_rope.json" "$out/real_rope.json" 2>/dev/null
  cp "$W/res/gpu_tests_all.log" "$W/res/controlnet/pipelines.json" "$W/res/rowwise_quant.json" "$out/" 2>/dev/null
  cp "$W/res/arithmetic/rowwise_quant.json" "$out/rowwise_arithmetic.json" 2>/dev/null
  for part in wan22 resolutions; do cp "$W/res/$part/pipelines.json" "$out/pipelines_$part.json" 2>/dev/null; done
  cp "$W/res/quality_fp8/quality.json" "$out/quality.json" 2>/dev/null
  cp "$W/res/norm_rope/norm_rope.json" "$out/norm_rope.json" 2>/dev/null
  tar czf "$out/res.tgz" -C "$W/res" --exclude='*.pt' .
  cat "$W/res/peer_goals.md"
  ;;
quick)  # CPU: every piece with tiny models; CPU-runnable stand-ins for the CUDA rows (the peer's row stays
        # and is "skipped: needs a CUDA device"), so that the report's ok-row path runs too
  rm -rf "$W"; mkdir -p "$W/res"
  FAST=hookkit-cache-fast DYN=hookkit-cache MOD=hookkit
  export PYTHONPATH="$PWD" QUICK=1 W RUNS="--runs 2 --warmup 1" PIECES FAST MOD DYN PEER
  queue
  report && cat "$W/res/peer_goals.md"
  ;;
*) echo "usage: $0 start | status | collect [WAIT_S] | quick" >&2; exit 2 ;;
esac
