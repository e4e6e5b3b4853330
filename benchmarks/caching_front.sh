#!/usr/bin/env bash
# Speed-quality fronts of every caching rule on the shipped trained models, on one GPU lease (nvidia-h200).
#
# For each MODEL:STEPS of $FRONTS, in parallel (one process each, float32 on the GPU):
#   1. benchmarks/tune_trained.py: hookkit.tune at 1.5x, 2x and 3x on every class at seed 10 (a seed that neither
#      the shipped calibrations, 50-59, nor the evaluation, 100 and up, use);
#   2. python -m hookkit.tools.front with those tuned Specs as extra rows: hookkit's rules, fewer steps and
#      every installed peer (diffusers' hooks, cache-dit) on classes 0-9 x seeds 100, 101.
# One background queue (setsid), so that it outlives a 10-minute device command; a later call collects.
#
#   one call:  bash benchmarks/caching_front.sh start && bash benchmarks/caching_front.sh collect 540
#              (waits up to 540 s, merges each front's finished groups, writes $OUT/front-MODEL-STEPS.md and fronts.tgz)
#
# `start` snapshots the working tree to $W/repo; benchmarks/gpu_env.sh installs the wheels of $WHL (default .whl: carry
# it; diffusers, importlib_metadata, zipp, torchao, loguru, cache-dit) into /tmp/site when they do not import, in
# `start` and again (a fresh shell) in `collect`.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
W=${W:-/tmp/hkfront}
FRONTS=${FRONTS:-"tiny:28 deep:28 tiny:14 deep:14"}
SPEEDUPS=${SPEEDUPS:-1.5,2,3}
DEVICE=${DEVICE:-cuda}
FRONT_ARGS=${FRONT_ARGS:-}   # more options of the front, e.g. "--classes 0 --seeds 100 --only tune" for a dry run

#: the front's families split among processes (--only / --skip), so the rows that run batch 1 (threshold rules, which
#: decide per image) spread over cores; `collect` merges each MODEL:STEPS back into one front
FRONT_GROUPS=(
  "--only 'hookkit F1B0 TaylorSeer-1'"
  "--only 'hookkit F1B0' --skip TaylorSeer"
  "--only FirstBlockCache"
  "--only 'cache-dit F1B0 TaylorSeer'"
  "--only cache-dit --skip TaylorSeer"
  "--skip 'hookkit F1B0,FirstBlockCache,cache-dit'"
)

one() {  # MODEL STEPS: tune, then the front's groups in parallel with the tuned Specs
  local model=$1 steps=$2 res="$W/res/front-$1-$2"
  mkdir -p "$res"
  cd "$W/repo" || return 1
  echo "$(date +%T) tune $model $steps" >> "$W/queue.log"
  python3 benchmarks/tune_trained.py --device "$DEVICE" --model "$model" --steps "$steps" --speedups "$SPEEDUPS" \
    --out "$res/tuned.json" > "$res/tune.log" 2>&1 || echo "$(date +%T) tune $model $steps failed" >> "$W/queue.log"
  local specs=""
  [ -f "$res/tuned.json" ] && specs="--specs $res/tuned.json"
  echo "$(date +%T) front $model $steps" >> "$W/queue.log"
  local i=0
  for group in "${FRONT_GROUPS[@]}"; do
    i=$((i + 1))
    eval python3 -m hookkit.tools.front --device "$DEVICE" --model "$model" --steps "$steps" $specs \
      $group $FRONT_ARGS --no-plot --out "$res/g$i" > "$res/g$i.log" 2>&1 &
  done
  wait
  echo "$(date +%T) done $model $steps" >> "$W/queue.log"
}

case "${1:-}" in
  start)
    rm -rf "$W" && mkdir -p "$W/res" "$W/repo" && tar -c --exclude=./.venv --exclude=./.whl . | tar -x -C "$W/repo" || exit 1
    source "$HERE/gpu_env.sh" && gpu_env "$W/repo" || exit 1
    export PYTHONUNBUFFERED=1 CACHE_DIT_LOG_LEVEL=error
    for mf in $FRONTS; do
      setsid bash -c "$(declare -p FRONT_GROUPS); $(declare -f one); W='$W' SPEEDUPS='$SPEEDUPS' DEVICE='$DEVICE' FRONT_ARGS='$FRONT_ARGS' PYTHONPATH='$PYTHONPATH' one ${mf%%:*} ${mf#*:}" \
        > /dev/null 2>&1 < /dev/null &
    done
    echo "started: $FRONTS"
    ;;
  status)
    cat "$W/queue.log" 2>/dev/null
    for f in "$W"/res/*/g*.log; do [ -f "$f" ] && echo "$f: $(grep -c '^\[' "$f") rows, last: $(tail -c 160 "$f" | tail -1)"; done
    ;;
  collect)
    wait_s=${2:-0}
    for _ in $(seq "$wait_s"); do
      [ "$(grep -c ' done ' "$W/queue.log" 2>/dev/null)" -ge "$(echo $FRONTS | wc -w)" ] && break
      sleep 1
    done
    bash "$0" status
    # the merge imports hookkit.tools (diffusers): a later device call is a fresh shell without PYTHONPATH
    source "$HERE/gpu_env.sh" && gpu_env "$W/repo" || echo "collecting the raw groups only" >&2
    out=${OUT:-out}; mkdir -p "$out"
    for d in "$W"/res/front-*; do  # merge the groups that finished into one front per MODEL:STEPS
      parts=$(ls -d "$d"/g*/front.json 2>/dev/null)
      [ -n "$parts" ] && (cd "$W/repo" && python3 -m hookkit.tools.front --merge $parts --out "$d/front" \
        > "$d/merge.log" 2>&1) && cp "$d/front/front.md" "$out/$(basename "$d").md"
    done
    tar -czf "$out/fronts.tgz" -C "$W/res" . && cp "$W/queue.log" "$out/" 2>/dev/null
    ls -la "$out"
    ;;
  *)
    echo "usage: bash benchmarks/caching_front.sh start | status | collect [WAIT_S]" >&2; exit 2
    ;;
esac
