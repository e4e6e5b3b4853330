#!/usr/bin/env bash
# Regional compile over five resolutions: recompiles and time per size.
# benchmarks/pipelines.py --parts resolutions --runs 2: dynamic shapes against a compile per size: pipelines.json.
# Settings: RES_STEPS (steps, 8), PIPELINES_ARGS (more options, e.g. --quick), T_PIPE (seconds, 330).
source "$(dirname "$0")/../suite_lib.sh"
# shellcheck disable=SC2086
timeout "${T_PIPE:-330}" python3 benchmarks/pipelines.py --parts resolutions --runs 2 --steps "${RES_STEPS:-8}" \
  ${PIPELINES_ARGS:-}
note "resolutions rc $?"
