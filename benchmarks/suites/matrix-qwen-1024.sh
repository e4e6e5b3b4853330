#!/usr/bin/env bash
# The `hookkit bench` matrix at Qwen-Image 1024², 28 steps, every row its own process.
# matrix.md, matrix.json, rows/.
# Settings: CONFIGS (comma-separated rows), MATRIX_TIMEOUT (seconds, 3600), benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
matrix qwenimage 1024 "${CONFIGS:-eager,regional-compile,hookkit-compile,hookkit-cuda-graphs,cache-dit,\
hookkit-cache-fast+compile,fbcache,hookkit-cache-fast,hookkit-fp8+compile,hookkit-all,hookkit-sync-free,\
regional-compile-ro,hookkit-compile-ro}"
