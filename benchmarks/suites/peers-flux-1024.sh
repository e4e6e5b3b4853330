#!/usr/bin/env bash
# Flux-dev 1024², warm caches: hookkit's fastest rows (P1024), side by side.
# Rows P1024 (space-separated, default FAST MOD; add PEER or UNCACHED as needed): CONFIG.json, CONFIG.err.
# Settings: P1024, and those of benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
for c in ${P1024:-$FAST $MOD}; do row flux 1024 "$c"; done
