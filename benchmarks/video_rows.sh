#!/usr/bin/env bash
# The video rows of `hookkit bench` on ONE H200 lease (nvidia-h200): full-size Wan 2.1 14B (random
# weights, bf16, random prompt embeddings, CFG 5.0: two transformer calls per step, latents out, no VAE decode) at
# 480x832 and 81 frames (32,760 latent tokens), `--configs video`: eager, stock regional compile, diffusers
# FirstBlockCache and MagCache, cache-dit + its fp8 + regional compile and hookkit's fastest (fp8 + DBCache +
# whole-transformer CUDA graphs), the last two on the same static "fast" computed steps (3 of 6). Each row is its own
# `hookkit bench-one` process (peak memory per row); PSNR on latents against the eager row.
# A few steps per row (default --steps 6, 1 warm-up + 2 timed calls) so that the matrix fits one lease: expected
# ~12 GPU minutes (about 2 a row: process start and the 14B build ~30 s, eager ~30 s a call of 6 steps, compiled rows
# ~1.5 min of compilation and capture). One background queue (setsid) outlives a 10-minute device command:
#
#   call 1:  bash benchmarks/video_rows.sh start && sleep 540 && bash benchmarks/video_rows.sh status
#   call 2:  bash benchmarks/video_rows.sh collect 420     # waits up to 420 s for the queue, then collects
#   CPU:     bash benchmarks/video_rows.sh quick           # the tiny Wan through the same matrix, synchronously
#
# `start` snapshots the working tree to $W/repo; benchmarks/gpu_env.sh installs the wheels of $WHL (default .whl: carry
# it) into /tmp/site when diffusers/torchao/loguru/cache_dit do not import. Settings (environment): ARCH (wan2.1-14b;
# wan2.1-1.3b, wan2.2-a14b), HEIGHT/WIDTH (480/832; 720/1280 for 720p), FRAMES (81), STEPS (6), RUNS
# ("--runs 2 --warmup 1"), CONFIGS (video, or comma-separated rows), ROW_TIMEOUT (seconds per row, 600).
# $OUT gets video_rows.md (the table), video_rows.json (`hookkit bench --json`), queue.log and rows.tgz (every row's
# JSON and stderr log).
set -u
W=${W:-/tmp/hkvideo}
ARCH=${ARCH:-wan2.1-14b}
HEIGHT=${HEIGHT:-480}
WIDTH=${WIDTH:-832}
FRAMES=${FRAMES:-81}
STEPS=${STEPS:-6}
RUNS=${RUNS:-"--runs 2 --warmup 1"}
CONFIGS=${CONFIGS:-video}
ROW_TIMEOUT=${ROW_TIMEOUT:-600}

log() { echo "[$(date -u +%H:%M:%S)] $*" >> "$W/res/queue.log"; }

matrix() {  # matrix MODEL_ARGS...: the rows in one `hookkit bench` (each row its own bench-one process)
  log "bench start: $CONFIGS $*"
  python3 -m hookkit bench --model wan --configs "$CONFIGS" $RUNS --steps "$STEPS" --frames "$FRAMES" "$@" \
    --timeout "$ROW_TIMEOUT" --out-dir "$W/res/rows" --json "$W/res/video_rows.json" \
    > "$W/res/video_rows.md" 2> "$W/res/bench.err"
  log "bench exit $?"
  rm -f "$W/res/rows/"*.pt
  echo done > "$W/res/queue.done"
}

rows_so_far() {  # the rows finished so far, from their JSON files (the table comes only when the matrix ends)
  python3 - "$W/res/rows" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    row = json.loads(path.read_text())
    print(f"{row['config']}: {row['status']} latency {row['latency_s']} s, peak {row['peak_memory_gb']} GB "
          f"{row['note'][:120]}")
EOF
}

case "${1:-}" in
start)
  rm -rf "$W"; mkdir -p "$W/res/rows"; cp -r . "$W/repo"; cd "$W/repo" || exit 1
  source benchmarks/gpu_env.sh && gpu_env "$W/repo" || exit 1
  nvidia-smi -L > "$W/res/gpus.txt" 2>&1
  export W ARCH HEIGHT WIDTH FRAMES STEPS RUNS CONFIGS ROW_TIMEOUT
  export -f log matrix
  setsid bash -c 'matrix --full --arch "$ARCH" --height "$HEIGHT" --width "$WIDTH"' > "$W/res/queue.out" 2>&1 < /dev/null &
  sleep 2; echo "started: $ARCH ${HEIGHT}x${WIDTH}, $FRAMES frames, $STEPS steps, --configs $CONFIGS"
  ;;
status)
  cat "$W/res/queue.log"; tail -3 "$W/res/bench.err"; rows_so_far
  ;;
collect)
  for _ in $(seq 1 "${2:-0}"); do [ -f "$W/res/queue.done" ] && break; sleep 1; done
  cd "$W/repo" || exit 1
  source benchmarks/gpu_env.sh && gpu_env "$W/repo" || echo "collecting without the packages" >&2
  [ -f "$W/res/queue.done" ] || echo "queue still running: collecting the rows that finished" | tee -a "$W/res/queue.log"
  out=${OUT:-out}; mkdir -p "$out"
  cp "$W/res/video_rows.md" "$W/res/video_rows.json" "$W/res/queue.log" "$out/" 2>/dev/null
  tar czf "$out/rows.tgz" -C "$W/res" --exclude='*.pt' rows bench.err gpus.txt
  cat "$W/res/video_rows.md"; rows_so_far
  ;;
quick)  # CPU: the tiny Wan (5 frames) through the same matrix; the CUDA-only rows are skipped rows that say so
  rm -rf "$W"; mkdir -p "$W/res/rows"
  export PYTHONPATH="$PWD"
  FRAMES=5 matrix --device cpu
  cat "$W/res/video_rows.md"
  ;;
*) echo "usage: $0 start | status | collect [WAIT_S] | quick" >&2; exit 2 ;;
esac
