#!/usr/bin/env bash
# Flux-dev 1024² cold start (fresh compiler caches): hookkit's fastest beside the peer.
# Rows FAST, MOD and PEER, first call and time to first image included; one `hookkit bench-one` process each:
# CONFIG.json, CONFIG.err. Settings: benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
for c in $FAST $MOD $PEER; do row flux 1024 "$c" cold; done
