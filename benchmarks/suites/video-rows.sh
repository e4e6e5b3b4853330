#!/usr/bin/env bash
# The video rows of `hookkit bench`: full-size Wan 2.1 14B (or MODEL), 480x832, 81 frames, one process a row.
# Random weights, bf16, random prompt embeddings, CFG 5.0 (two transformer calls per step), latents out, no VAE decode,
# 32,760 latent tokens at the defaults. `--configs video`: eager, stock regional compile, diffusers FirstBlockCache and
# MagCache, cache-dit + its fp8 + regional compile and hookkit's fastest (fp8 + DBCache + whole-transformer CUDA
# graphs), the last two on the same static "fast" computed steps (3 of 6). Each row is its own `hookkit bench-one`
# process (peak memory per row); PSNR on latents against the eager row. A few steps per row (6, 1 warm-up + 2 timed
# calls) so that the matrix fits one lease: ~12 GPU minutes on one H200 (about 2 a row: process start and the 14B
# build ~30 s, eager ~30 s a call, compiled rows ~1.5 min of compilation and capture).
# Writes video_rows.md (the table), video_rows.json (`hookkit bench --json`), bench.err and rows/ (every row's JSON
# and stderr log). Settings: MODEL (wan; hunyuanvideo15), ARCH (wan2.1-14b for wan; wan2.1-1.3b, wan2.2-a14b;
# hunyuanvideo1.5-480p for hunyuanvideo15), HEIGHT/WIDTH (480/832; 720/1280 for 720p),
# FRAMES (81), STEPS (6), CONFIGS (video, or comma-separated rows), RUNS (here "--runs 2 --warmup 1"), ROW_TIMEOUT
# (here 600 s a row), NO_EAGER=1 (no eager reference row, ~2 minutes less: for rows that `hookkit bench --merge`
# joins to a run that has one). QUICK=1: the tiny model of MODEL on the CPU, 5 frames, through the same matrix (the
# CUDA-only rows are skipped rows that say so).
video_runs=${RUNS:-"--runs 2 --warmup 1"} video_row_timeout=${ROW_TIMEOUT:-600}  # before the shared defaults
source "$(dirname "$0")/../suite_lib.sh"
MODEL=${MODEL:-wan}
if [ "$MODEL" = wan ]; then ARCH=${ARCH:-wan2.1-14b}; else ARCH=${ARCH:-hunyuanvideo1.5-480p}; fi
HEIGHT=${HEIGHT:-480} WIDTH=${WIDTH:-832} FRAMES=${FRAMES:-81} STEPS=${STEPS:-6}
CONFIGS=${CONFIGS:-video}
if [ "$QUICK" = 1 ]; then
  model_args=(--device cpu) FRAMES=5
else
  model_args=(--full --arch "$ARCH" --height "$HEIGHT" --width "$WIDTH")
fi
mkdir -p "$OUT/rows"
note "bench start: $MODEL $CONFIGS ${model_args[*]}, $FRAMES frames, $STEPS steps"
[ "${NO_EAGER:-0}" = 1 ] && model_args+=(--no-eager)
# shellcheck disable=SC2086 # video_runs is a word list
python3 -m hookkit bench --model "$MODEL" --configs "$CONFIGS" $video_runs --steps "$STEPS" --frames "$FRAMES" \
  "${model_args[@]}" --timeout "$video_row_timeout" --out-dir "$OUT/rows" --json "$OUT/video_rows.json" \
  > "$OUT/video_rows.md" 2> "$OUT/bench.err"
note "bench exit $?"
rm -f "$OUT/rows/"*.pt
cat "$OUT/video_rows.md"
python3 - "$OUT/rows" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    row = json.loads(path.read_text())
    graphs = ((row.get("features") or {}).get("compile") or {}).get("graph_memory_bytes")
    kept = f", captured graphs {', '.join(f'{b / 2**30:.2f}' for b in graphs)} GiB" if graphs else ""
    print(f"{row['config']}: {row['status']} latency {row['latency_s']} s, peak {row['peak_memory_gb']} GB{kept} "
          f"{row['note'][:120]}")
PY
