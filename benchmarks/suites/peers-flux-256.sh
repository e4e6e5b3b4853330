#!/usr/bin/env bash
# Flux-dev 256²: hookkit's fastest beside the peer.
# Rows P256 (default FAST MOD PEER): CONFIG.json, CONFIG.err. Settings: P256, and those of benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
for c in ${P256:-$FAST $MOD $PEER}; do row flux 256 "$c"; done
