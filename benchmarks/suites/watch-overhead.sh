#!/usr/bin/env bash
# The host cost per call of the CUDA-graph model watch.
# benchmarks/watch_overhead.py --quick: watch_overhead.json. Settings: T_WATCH (seconds, 40).
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_WATCH:-40}" python3 benchmarks/watch_overhead.py --quick --out "$OUT"
note "watch rc $?"
