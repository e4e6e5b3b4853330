#!/usr/bin/env bash
# Every `-m gpu` test of GPU_TESTS (default tests/), and every `-m hopper_build` one (kernels built for Hopper by this
# machine's Triton, whose builds differ from the CPU machine's), the 30 slowest listed; the failed tests' ids in the
# suite's log. Writes gpu_tests.log. Settings: GPU_TESTS (test files or node ids, one word: GPU_TESTS="a.py b.py"),
# T_TESTS (seconds, 600; at its end pytest is interrupted with SIGINT, so that it still names the tests failed so far).
source "$(dirname "$0")/../suite_lib.sh"
# shellcheck disable=SC2086 # GPU_TESTS is a word list
timeout -s INT -k 30 "${T_TESTS:-600}" python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper_build" -rfE \
  --durations=30 -o faulthandler_timeout=150 ${GPU_TESTS:-tests/} > "$OUT/gpu_tests.log" 2>&1
note "gpu tests rc $? $(tail -1 "$OUT/gpu_tests.log")"
grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | cut -c1-200 | while read -r line; do note "$line"; done
