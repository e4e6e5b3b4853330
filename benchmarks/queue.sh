#!/usr/bin/env bash
# The benchmark queue of a GPU lease: runs named suites (benchmarks/suites/NAME.sh, one per measurement; `list`
# names them) one after another in the background (setsid), so that they outlive one 10-minute device command.
# Each suite writes under $W/res/NAME/ (W: /tmp/hkqueue unless set), its output in NAME/suite.log.
#
#   bash benchmarks/queue.sh list                        the suites, one line each
#   bash benchmarks/queue.sh start SUITE... [-- SUITE...]
#       snapshots the working tree to $W/repo (later device calls may replace the tree), makes the packages import
#       (benchmarks/gpu_env.sh: carry .whl) and starts the queue. Each `--` starts one more queue beside it; with
#       more than one, queue i sees only GPU i (CUDA_VISIBLE_DEVICES=i). Settings are environment variables, read
#       when each suite runs (each suite's header names its own; benchmarks/suite_lib.sh the shared ones).
#   bash benchmarks/queue.sh status                      the queue's log and the running suites' last lines
#   bash benchmarks/queue.sh collect [WAIT_S]
#       waits up to WAIT_S seconds for the queue, then writes to $OUT (out unless set): queue.log, summary.md (each
#       suite's exit status, time and last lines), results.tgz (every suite's folder, *.pt left out) and, when a
#       peers-* or step-profile suite ran, peer_goals.md and .json (benchmarks/peer_goals_report.py). Works in a
#       later device call (a fresh shell); what has not finished is collected as it stands.
#   bash benchmarks/queue.sh run SUITE...                the same suites synchronously in this tree, into $W/res
#                                                        (QUICK=1: the CPU plumbing check with tiny models)
# A word VAR=value among the suites (start and run) sets VAR for the suites after it in its queue, so that two suites
# reading the same setting get their own: start gpu-tests ROWS=a,b video-rows-wan21-flashinfer ROWS=c video-rows-....
#
# A lease of one command at a time, e.g. on nvidia-h200. The machine is given back 30 s after a call returns, and
# a late next call starts a bare one (the queue and its results gone), so each call runs what fits in it and
# collects before it returns:
#   source benchmarks/gpu_env.sh && gpu_env || exit 1
#   export W=/tmp/hk; bash benchmarks/queue.sh run attention-flashinfer gpu-tests; bash benchmarks/queue.sh collect 0
# (one `run` a call, naming every suite: each `run` empties $W/res first).
# `start` with a `collect` in a later call is for queues longer than a call, when the calls follow each other at once.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
export W=${W:-/tmp/hkqueue}
RES=$W/res

usage() {
  cat >&2 <<EOF
usage: bash benchmarks/queue.sh list
       bash benchmarks/queue.sh start SUITE... [-- SUITE...]
       bash benchmarks/queue.sh status
       bash benchmarks/queue.sh collect [WAIT_S]
       bash benchmarks/queue.sh run SUITE...
(bash benchmarks/queue.sh list names the suites)
EOF
  exit 2
}

known() {  # the suites' names, sorted
  local f
  for f in "$HERE"/suites/*.sh; do basename "$f" .sh; done
}

check_suites() {  # check_suites ARG...: every ARG a suite or `--`, at least one suite; else say which are known, exit 2
  local s bad=0 any=0
  for s in "$@"; do
    [ "$s" = -- ] && continue
    setting "$s" && continue
    any=1
    [ -f "$HERE/suites/$s.sh" ] && continue
    echo "queue.sh: unknown suite '$s'; known suites: $(known | tr '\n' ' ')" >&2
    bad=1
  done
  [ "$any" = 1 ] || usage
  [ "$bad" = 0 ] || exit 2
}

setting() {  # setting WORD: true when WORD is a VAR=value setting of the suites after it, not a suite
  [[ $1 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]
}

log() {  # log TEXT: one time-stamped line of queue.log
  echo "[$(date -u +%H:%M:%S)] $*" >> "$RES/queue.log"
}

write_settings() {  # the shared settings as the suites will see them, for `collect`'s report in a later shell
  (
    OUT=$RES
    source "$HERE/suite_lib.sh"
    for v in $SUITE_SETTINGS; do printf 'export %s=%q\n' "$v" "${!v}"; done
  ) > "$RES/settings.env"
}

run_suite() {  # run_suite NAME: one suite in this checkout, into $RES/NAME/
  local name=$1 dir=$RES/$1 start=$SECONDS rc
  mkdir -p "$dir"
  log "$name start${LANE:+ (queue $LANE)}"
  OUT=$dir bash "benchmarks/suites/$name.sh" > "$dir/suite.log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - start))" > "$dir/suite.rc"
  log "$name exit $rc after $((SECONDS - start)) s"
}

lane() {  # lane N SUITE...: one queue (started by `start`, in the snapshot)
  local n=$1 s
  shift
  cd "$REPO" || exit 1
  for s in "$@"; do
    if setting "$s"; then export "${s?}" && log "setting $s"; else LANE=$n run_suite "$s"; fi
  done
  echo done > "$RES/lane$n.done"
}

finished() {  # true when every queue of `start` (or `run`) has written its .done
  [ -f "$RES/lanes" ] || return 1
  [ "$(find "$RES" -maxdepth 1 -name 'lane*.done' | wc -l)" -ge "$(cat "$RES/lanes")" ]
}

running() {  # true while a queue started here is still alive
  local pid
  for pid in $(cat "$RES"/lane*.pid 2>/dev/null); do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

report() {  # peer_goals.md/.json from the peers-* rows and the step profile, when any of them ran
  compgen -G "$RES/peers-*" > /dev/null || [ -d "$RES/step-profile" ] || return 0
  [ -f "$RES/settings.env" ] && source "$RES/settings.env"
  python3 "$HERE/peer_goals_report.py" "$RES" --out "$RES" > /dev/null 2> "$RES/report.err" ||
    echo "queue.sh: peer_goals_report.py failed: $(tail -1 "$RES/report.err")" >&2
}

summary() {  # one section per suite, in the order they started: exit status, seconds, files, last lines of its log
  local name dir
  echo "# benchmark queue in $W"
  echo
  grep -o '] [^ ]* start' "$RES/queue.log" 2>/dev/null | cut -d' ' -f2 | while read -r name; do
    dir=$RES/$name
    if [ -f "$dir/suite.rc" ]; then
      read -r rc seconds < "$dir/suite.rc"
      echo "## $name: exit $rc after $seconds s"
    else
      echo "## $name: still running"
    fi
    echo
    echo "files: $(cd "$dir" && find . -type f ! -name '*.pt' | sed 's|^\./||' | sort | head -30 | tr '\n' ' ')"
    echo
    echo '```'
    tail -n "${SUMMARY_LINES:-15}" "$dir/suite.log" 2>/dev/null | cut -c1-300
    echo '```'
    echo
  done
  [ -f "$RES/peer_goals.md" ] && cat "$RES/peer_goals.md"
}

case "${1:-}" in
list)
  for name in $(known); do printf '%-22s %s\n' "$name" "$(sed -n '2s/^# //p' "$HERE/suites/$name.sh")"; done
  ;;
start)
  shift
  check_suites "$@"
  if running; then
    echo "queue.sh: a queue is still running in $W: status, collect, or W=another folder for a second one" >&2
    exit 1
  fi
  rm -rf "$W" && mkdir -p "$RES" "$W/repo" || exit 1
  (cd "$REPO" && tar -c --exclude=./.git --exclude=./.venv --exclude=./.whl .) | tar -x -C "$W/repo" || exit 1
  source "$HERE/gpu_env.sh" && gpu_env "$W/repo" || exit 1
  export WHL=${WHL:-$REPO/.whl}  # the snapshot has no .whl: suites read prebuilt archives from the checkout's
  nvidia-smi -L > "$RES/gpus.txt" 2>&1
  write_settings
  lanes=() current=""
  for s in "$@"; do
    # each word shell-quoted, so that a setting holding spaces (GPU_TESTS="a.py b.py") stays one word
    if [ "$s" = -- ]; then lanes+=("$current"); current=""; else current="$current $(printf %q "$s")"; fi
  done
  lanes+=("$current")
  echo "${#lanes[@]}" > "$RES/lanes"
  for n in "${!lanes[@]}"; do
    gpu=()
    [ "${#lanes[@]}" -gt 1 ] && gpu=(env "CUDA_VISIBLE_DEVICES=$n")
    eval "words=(${lanes[$n]})"
    "${gpu[@]}" setsid bash "$W/repo/benchmarks/queue.sh" lane "$n" "${words[@]}" > "$RES/lane$n.out" 2>&1 < /dev/null &
    echo $! > "$RES/lane$n.pid"
    echo "started queue $n:${lanes[$n]}"
  done
  ;;
lane)
  shift
  lane "$@"
  ;;
status)
  [ -d "$RES" ] || { echo "queue.sh: no queue in $W (start one first)" >&2; exit 1; }
  cat "$RES/queue.log" 2>/dev/null
  finished && echo "queue finished" || { running && echo "queue running" || echo "queue stopped before the end"; }
  for dir in "$RES"/*/; do
    [ -f "$dir/suite.log" ] && [ ! -f "$dir/suite.rc" ] || continue
    echo "== $(basename "$dir") (running), last lines:"
    tail -n 5 "$dir/suite.log" | cut -c1-300
  done
  ;;
collect)
  for _ in $(seq 1 "${2:-0}"); do finished && break; sleep 1; done
  [ -d "$RES" ] || { echo "queue.sh: no queue in $W (start one first)" >&2; exit 1; }
  finished || echo "queue still running: collecting what has finished" | tee -a "$RES/queue.log"
  report
  out=${OUT:-out}
  mkdir -p "$out"
  summary > "$RES/summary.md"
  cp "$RES/summary.md" "$RES/queue.log" "$out/"
  cp "$RES/peer_goals.md" "$RES/peer_goals.json" "$out/" 2>/dev/null
  tar -czf "$out/results.tgz" -C "$RES" --exclude='*.pt' .
  cat "$RES/summary.md"
  ;;
run)
  shift
  check_suites "$@"
  for s in "$@"; do
    [ "$s" != -- ] || { echo "queue.sh: run takes no --: its suites run one after another" >&2; exit 2; }
  done
  rm -rf "$RES" && mkdir -p "$RES" || exit 1
  source "$HERE/gpu_env.sh" && gpu_env "$REPO" || exit 1
  write_settings
  echo 1 > "$RES/lanes"
  (lane 0 "$@")
  report
  summary > "$RES/summary.md"
  cat "$RES/summary.md"
  ;;
*)
  usage
  ;;
esac
