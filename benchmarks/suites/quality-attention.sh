#!/usr/bin/env bash
# Image quality of the low-precision attention kernels (hookkit_int8, hookkit_fp8, FlashInfer's FA3 fp8 and bf16 kernels
# where flashinfer imports, the heads zero-padded; sageattention where it takes the
# heads) on the shipped trained tiny and deep Flux, against bf16 SDPA, on held-out seeds (100..), and each kernel's
# attention-output error on the models' own Q, K, V. benchmarks/quality_attention.py: {tiny,deep}/quality.{json,md},
# attention_error.json. Settings: SEEDS (4), T_QUALITY (seconds, 600); QUICK=1 runs --quick on the CPU.
source "$(dirname "$0")/../suite_lib.sh"
quick=""
[ "$QUICK" = 1 ] && quick="--quick"
timeout "${T_QUALITY:-600}" python3 benchmarks/quality_attention.py $quick --seeds "${SEEDS:-4}" --out "$OUT"
note "quality rc $?"
