#!/usr/bin/env bash
# Flux-dev 1024² with max-autotune GEMMs, when step-profile found them >= 2 % faster per step.
# Runs after step-profile in the same queue (reads ../step-profile/step_profile.json, which needs VARIANTS with
# native+mod and native+mod+autotune): one row of AUTOTUNE, CONFIG.json. Settings: benchmarks/suite_lib.sh.
source "$(dirname "$0")/../suite_lib.sh"
profile="$OUT/../step-profile/step_profile.json"
if python3 -c 'import json, sys
rows = {r["variant"]: r for r in json.load(open(sys.argv[1]))["rows"] if r.get("status") == "ok"}
a, b = rows.get("native+mod+autotune"), rows.get("native+mod")
sys.exit(0 if a and b and a["step_ms"] <= 0.98 * b["step_ms"] else 1)' "$profile" 2>/dev/null; then
  row flux 1024 "$AUTOTUNE"
else
  note "autotune row skipped: $profile does not show native+mod+autotune >= 2 % faster per step" \
    "(run step-profile first with VARIANTS including native+mod and native+mod+autotune)"
fi
