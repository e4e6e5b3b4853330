#!/usr/bin/env bash
# The query/key RMSNorm + RoPE kernel's variants against inductor's, per model form.
# benchmarks/norm_rope.py: norm_rope.json. Settings: T_NR (seconds, 300).
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_NR:-300}" python3 benchmarks/norm_rope.py --out "$OUT"
note "norm-rope rc $?"
