#!/usr/bin/env bash
# FlashAttention-3's own Hopper kernels beside FlashInfer's port of them and cuDNN SDPA at Wan 2.1 14B's shape (40
# heads x 128, 32,760 tokens), in one process: does FA3's own e4m3 kernel (128 x 224 tiles) reach what FlashInfer's
# (128 x 192, 1.51x cuDNN) does not, 1.6x cuDNN? Each kernel alone on inputs quantized once, with its error. Needs
# .whl/fa3-site.tar.gz (benchmarks/fa3_site.py) and .whl/flashinfer-site.tar.gz (gpu_env.sh unpacks both).
# attention_fa3.json and .log. ~2 GPU minutes. Settings: T_FA3 (seconds, 400).
source "$(dirname "$0")/../suite_lib.sh"
kernel_times attention_fa3 "${T_FA3:-400}" sdpa_cudnn flashinfer_fp8_kernel fa3_fp8_kernel fa3_bf16
