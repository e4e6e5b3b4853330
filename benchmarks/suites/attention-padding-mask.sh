#!/usr/bin/env bash
# SDPA under HunyuanVideo 1.5's padding mask at 480x832x81 beside the valid prefix and hookkit's masked kernels.
# benchmarks/attention_padding_mask.py: attention_padding_mask.json. Settings: T_APM (seconds, 300).
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_APM:-300}" python3 benchmarks/attention_padding_mask.py "$OUT/attention_padding_mask.json"
note "attention-padding-mask rc $?"
