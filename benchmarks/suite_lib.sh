# Sourced by every benchmarks/suites/NAME.sh: the settings that several suites share, and their three helpers (one
# `hookkit bench-one` row, one `hookkit bench` matrix, one attention_kernels.py process). A suite runs in the repository root and writes under $OUT;
# benchmarks/queue.sh sets OUT to $W/res/NAME. By hand, on a machine where hookkit and its packages import:
#
#   OUT=out/peers-flux-512 bash benchmarks/suites/peers-flux-512.sh
#
# Shared settings (environment):
#   RUNS         timing arguments of every row (default "--runs 3 --warmup 1 --steps 28")
#   ROW_TIMEOUT  seconds per row (default 900)
#   QUICK=1      the CPU plumbing check: tiny models, 6 steps, CPU-runnable stand-ins for FAST, MOD and DYN (the
#                numbers mean nothing); suites that have no CPU form ignore it
#   FAST, MOD, DYN, PEER, AUTOTUNE, UNCACHED   the configurations of the peers-* rows (benchmarks/peer_goals_report.py
#                reads the same names); an empty value drops that row
set -u
export OUT=${OUT:-out}
mkdir -p "$OUT"
RUNS=${RUNS:-"--runs 3 --warmup 1 --steps 28"}
ROW_TIMEOUT=${ROW_TIMEOUT:-900}
QUICK=${QUICK:-0}
if [ "$QUICK" = 1 ]; then
  FAST=${FAST-hookkit-cache-fast} MOD=${MOD-hookkit} DYN=${DYN-hookkit-cache}
else
  FAST=${FAST-hookkit-fp8+cache-fast+cuda-graphs}
  MOD=${MOD-hookkit-fp8-mod+cache-fast+cuda-graphs}
  DYN=${DYN-hookkit-fp8+cache-dyn+cuda-graphs}
fi
PEER=${PEER-cache-dit+fp8+compile}
AUTOTUNE=${AUTOTUNE-hookkit-fp8-mod+cache-fast+cuda-graphs+autotune}
UNCACHED=${UNCACHED-hookkit-fp8-mod+cuda-graphs}
export RUNS ROW_TIMEOUT QUICK FAST MOD DYN PEER AUTOTUNE UNCACHED

#: the variables above, which benchmarks/queue.sh records for its report
SUITE_SETTINGS="RUNS ROW_TIMEOUT QUICK FAST MOD DYN PEER AUTOTUNE UNCACHED"

note() {  # note TEXT: one time-stamped line of the suite's log
  echo "[$(date -u +%H:%M:%S)] $*"
}

kernel_times() {  # kernel_times NAME SECONDS KERNEL... [-- ARG...]: one benchmarks/attention_kernels.py process at
  # Wan 2.1 14B's attention (40 heads x 128, 32,760 tokens) timing the KERNELs (ARGs after `--` passed on), into
  # $OUT/NAME.json and NAME.log; notes its exit status and each kernel's summary line
  local name=$1 seconds=$2 kernels=() extra=() rc
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do kernels+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  timeout "$seconds" python3 benchmarks/attention_kernels.py --heads 40 --kernels "${kernels[@]}" "${extra[@]}" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  rc=$?
  note "$name rc $rc $(grep -E "^($(IFS='|'; echo "${kernels[*]}")) " "$OUT/$name.log" | tr -s ' ' | cut -c1-160 \
    | tr '\n' ';')"
}

row() {  # row MODEL SIZE CONFIG [cold]: one `hookkit bench-one` process; $OUT/CONFIG.json and CONFIG.err
  # "cold": fresh inductor and Triton caches, so that the row's first call and time to first image are a cold start
  local model=$1 size=$2 config=$3 cold=${4:-} size_args="--full --height $2 --width $2" caches="" rc
  [ -n "$config" ] || return 0
  [ "$QUICK" = 1 ] && size_args="--steps 6"
  note "row $model ${size}² $config ${cold:+(cold) }start"
  if [ "$cold" = cold ]; then
    caches=$(mktemp -d)
    mkdir -p "$caches/inductor" "$caches/triton"
    export TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" HOOKKIT_BENCH_COLD=1
  fi
  # shellcheck disable=SC2086 # RUNS and size_args are word lists
  timeout "$ROW_TIMEOUT" python3 -m hookkit bench-one --config "$config" --model "$model" $RUNS $size_args \
    --out-dir "$OUT" --result "$OUT/$config.json" > /dev/null 2> "$OUT/$config.err"
  rc=$?
  if [ -n "$caches" ]; then
    rm -rf "$caches"
    unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR HOOKKIT_BENCH_COLD
  fi
  rm -f "$OUT/$config.pt"
  note "row $config exit $rc $(python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["status"], r["latency_s"], r["note"][:100])' "$OUT/$config.json" 2>/dev/null)"
}

matrix() {  # matrix MODEL SIZE CONFIGS: one `hookkit bench` (each row its own process); $OUT/matrix.md, .json, rows/
  local size_args="--full --height $2 --width $2"
  [ "$QUICK" = 1 ] && size_args="--steps 6"
  note "matrix $1 ${2}² start: $3"
  # shellcheck disable=SC2086
  timeout "${MATRIX_TIMEOUT:-3600}" python3 -m hookkit bench --model "$1" $RUNS $size_args \
    --configs "$3" --out-dir "$OUT/rows" --json "$OUT/matrix.json" > "$OUT/matrix.md" 2> "$OUT/matrix.err"
  note "matrix exit $?"
  rm -f "$OUT/rows/"*.pt
  cat "$OUT/matrix.md"
}
