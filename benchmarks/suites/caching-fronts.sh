#!/usr/bin/env bash
# Speed-quality fronts of every caching rule and installed peer on the shipped trained models, tuned Specs included.
# For each MODEL:STEPS of FRONTS, in parallel (float32 on DEVICE): benchmarks/tune_trained.py, hookkit.tune at
# SPEEDUPS on every class at seed 10 (neither the shipped calibrations, 50-59, nor the evaluation, 100 and up, use it:
# front-MODEL-STEPS/tuned.json, tune.log); then `python -m hookkit.tools.front` with those Specs as extra rows
# (hookkit's rules, fewer steps, every installed peer: diffusers' hooks, cache-dit) on classes 0-9 x seeds 100, 101,
# its families split among processes (front-MODEL-STEPS/g1..g6/, g*.log) so that the rows deciding per image (batch 1)
# spread over cores; the groups that finished are merged into front-MODEL-STEPS/front/ (front.md, .json) and
# front-MODEL-STEPS.md.
# Settings: FRONTS (default "tiny:28 deep:28 tiny:14 deep:14"), SPEEDUPS (1.5,2,3), DEVICE (cuda), FRONT_ARGS (more
# options of every front process, e.g. "--classes 0 --seeds 100"). QUICK=1: the CPU plumbing check, tiny:6 on the
# CPU, speed-up 2, class 0, seed 100, the tuned Specs and fewer steps in one process.
source "$(dirname "$0")/../suite_lib.sh"
export CACHE_DIT_LOG_LEVEL=error
if [ "$QUICK" = 1 ]; then
  FRONTS=${FRONTS:-tiny:6} SPEEDUPS=${SPEEDUPS:-2} DEVICE=${DEVICE:-cpu}
  FRONT_ARGS=${FRONT_ARGS:-"--classes 0 --seeds 100"}
  FRONT_GROUPS=("--only 'hookkit tune,fewer steps'")
else
  FRONTS=${FRONTS:-"tiny:28 deep:28 tiny:14 deep:14"} SPEEDUPS=${SPEEDUPS:-1.5,2,3} DEVICE=${DEVICE:-cuda}
  FRONT_ARGS=${FRONT_ARGS:-}
  #: the front's families split among processes (--only / --skip); the merge puts each MODEL:STEPS back together
  FRONT_GROUPS=(
    "--only 'hookkit F1B0 TaylorSeer-1'"
    "--only 'hookkit F1B0' --skip TaylorSeer"
    "--only FirstBlockCache"
    "--only 'cache-dit F1B0 TaylorSeer'"
    "--only cache-dit --skip TaylorSeer"
    "--skip 'hookkit F1B0,FirstBlockCache,cache-dit'"
  )
fi

one() {  # one MODEL STEPS: tune, then the front's groups in parallel with the tuned Specs, into $OUT/front-MODEL-STEPS
  local model=$1 steps=$2 res="$OUT/front-$1-$2" specs="" group i=0
  mkdir -p "$res"
  note "tune $model $steps start"
  python3 benchmarks/tune_trained.py --device "$DEVICE" --model "$model" --steps "$steps" --speedups "$SPEEDUPS" \
    --out "$res/tuned.json" > "$res/tune.log" 2>&1
  note "tune $model $steps rc $?"
  [ -f "$res/tuned.json" ] && specs="--specs $res/tuned.json"
  note "front $model $steps start: ${#FRONT_GROUPS[@]} processes"
  for group in "${FRONT_GROUPS[@]}"; do
    i=$((i + 1))
    eval python3 -m hookkit.tools.front --device "$DEVICE" --model "$model" --steps "$steps" $specs \
      "$group" "$FRONT_ARGS" --no-plot --out "$res/g$i" > "$res/g$i.log" 2>&1 &
  done
  wait
  note "front $model $steps done: $(cat "$res"/g*.log | grep -c '^\[') rows"
}

for mf in $FRONTS; do
  one "${mf%%:*}" "${mf#*:}" &
done
wait
for res in "$OUT"/front-*/; do  # merge the groups that finished into one front per MODEL:STEPS
  res=${res%/}
  parts=$(ls "$res"/g*/front.json 2>/dev/null)
  # shellcheck disable=SC2086 # parts is a list of paths
  [ -n "$parts" ] && python3 -m hookkit.tools.front --merge $parts --out "$res/front" > "$res/merge.log" 2>&1 &&
    cp "$res/front/front.md" "$res.md"
  note "merge $(basename "$res") rc $?"
done
cat "$OUT"/front-*.md 2>/dev/null
