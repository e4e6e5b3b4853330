#!/usr/bin/env bash
# hookkit's fp8 attention kernel at Wan 2.1 14B's shape (40 heads x 128, 32,760 tokens) beside cuDNN SDPA, in one
# process: as `Attention` runs it (V smoothed), with V as it comes, and the kernel alone on inputs quantized once: is
# the time in the kernel or in its quantization passes? (It found a kernel whose key loop spilled registers:
# benchmarks/kernel_spills.py checks that on the CPU.) attention_hookkit_fp8.json and .log. ~1 GPU minute.
# Settings: T_KERNELS (seconds, 300).
source "$(dirname "$0")/../suite_lib.sh"
kernel_times attention_hookkit_fp8 "${T_KERNELS:-300}" sdpa_cudnn hookkit_fp8 hookkit_fp8_unsmoothed_v hookkit_fp8_kernel
