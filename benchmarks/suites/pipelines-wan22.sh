#!/usr/bin/env bash
# Wan 2.2 A14B's two experts (480x832, 5 frames), eager and compiled.
# benchmarks/pipelines.py --parts wan22 --runs 2: stock eager against DBCache + regional compile: pipelines.json.
# Settings: PIPELINES_ARGS (more options, e.g. --quick), T_PIPE (seconds, 330).
source "$(dirname "$0")/../suite_lib.sh"
# shellcheck disable=SC2086
timeout "${T_PIPE:-330}" python3 benchmarks/pipelines.py --parts wan22 --runs 2 ${PIPELINES_ARGS:-}
note "wan22 rc $?"
