#!/usr/bin/env bash
# Flux-dev 512²: hookkit's fastest, dynamic DBCache under graphs, beside the peer.
# Rows P512 (default FAST DYN MOD PEER): CONFIG.json, CONFIG.err. Settings: P512, and those of benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
for c in ${P512:-$FAST $DYN $MOD $PEER}; do row flux 512 "$c"; done
