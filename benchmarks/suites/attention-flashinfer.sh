#!/usr/bin/env bash
# FlashInfer's FA3 kernels beside cuDNN SDPA and hookkit's fp8 kernel at Wan 2.1 14B's shape (40 heads x 128, 32,760
# tokens): its bf16 kernel; its fp8 kernel with hookkit's quantization (torch ops, and compiled) and alone; and
# TensorRT-LLM's FMHA v2 e4m3 and bf16 kernels where .whl/fmha-v2-site.tar.gz holds them (benchmarks/fmha_v2_site.py);
# each with its error; then the GPU tests. Needs .whl/flashinfer-site.tar.gz (benchmarks/flashinfer_site.py;
# gpu_env.sh unpacks it, with the kernels prebuilt). attention_flashinfer.json and .log, attention_fmha_v2.json and
# .log, gpu_tests_flashinfer.log (failed tests named in the suite's log). Settings: T_AFI (seconds, 600), T_TESTS
# (seconds, 420; then SIGINT, so that pytest names the tests failed so far).
source "$(dirname "$0")/../suite_lib.sh"
kernel_times attention_flashinfer "${T_AFI:-600}" sdpa_cudnn hookkit_fp8 flashinfer_bf16 flashinfer_fp8 \
  flashinfer_fp8_unsmoothed_v flashinfer_fp8_compiled flashinfer_fp8_kernel
# FMHA v2 in a process of its own (its CUDA error checks end the process), cuDNN again beside it
kernel_times attention_fmha_v2 "${T_AFI:-600}" sdpa_cudnn fmha_v2_fp8_kernel fmha_v2_bf16
timeout -s INT -k 30 "${T_TESTS:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
  tests/test_attention_flashinfer.py > "$OUT/gpu_tests_flashinfer.log" 2>&1
note "flashinfer gpu tests rc $? $(tail -1 "$OUT/gpu_tests_flashinfer.log")"
grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests_flashinfer.log" | cut -c1-200 | while read -r line; do note "$line"; done
