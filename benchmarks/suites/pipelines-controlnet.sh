#!/usr/bin/env bash
# Flux ControlNet 1024², 28 steps, eager and compiled.
# benchmarks/pipelines.py --parts controlnet: uncached against DBCache on the "fast" mask: pipelines.json.
# Settings: PIPELINES_ARGS (more options, e.g. --quick), T_PIPE (seconds, 330).
source "$(dirname "$0")/../suite_lib.sh"
# shellcheck disable=SC2086
timeout "${T_PIPE:-330}" python3 benchmarks/pipelines.py --parts controlnet ${PIPELINES_ARGS:-}
note "controlnet rc $?"
