#!/usr/bin/env bash
# Qwen-Image 1024²: hookkit's fastest beside the peer, latency and memory.
# Rows PQWEN (default FAST MOD PEER): CONFIG.json, CONFIG.err. Settings: PQWEN, and those of benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
for c in ${PQWEN:-$FAST $MOD $PEER}; do row qwenimage 1024 "$c"; done
