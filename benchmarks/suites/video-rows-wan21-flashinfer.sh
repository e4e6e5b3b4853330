#!/usr/bin/env bash
# Wan 2.1 14B, 480x832, 81 frames (32,760 tokens): the rows that decide its goals, with FlashInfer's FA3 kernels.
# The video-rows suite (benchmarks/suites/video-rows.sh) with MODEL=wan, ARCH=wan2.1-14b and the rows ROWS names
# (default: stock regional compile and cache-dit + its fp8 + regional compile, the references of the uncached and the
# cached goal; hookkit fp8 + regional compile with FlashInfer's bf16 and with its fp8 attention, uncached; hookkit fp8 +
# DBCache "fast" + regional compile with the fp8 attention of hookkit's Triton kernel and of FlashInfer, on cache-dit's
# computed steps; stock eager is added as the reference). Needs .whl/flashinfer-site.tar.gz (the FlashInfer rows are
# skipped rows without it). ~14 GPU minutes on one H200, more than one device call: give each call a part of the
# rows (ROWS), each goal's reference beside its hookkit rows. Settings: ROWS, RUNS, ROW_TIMEOUT and NO_EAGER as
# video-rows.sh takes them; HEIGHT, WIDTH, FRAMES, STEPS pass through.
runs=${RUNS:-"--runs 2 --warmup 1"} row_timeout=${ROW_TIMEOUT:-600}  # before the shared defaults
source "$(dirname "$0")/../suite_lib.sh"
rows=${ROWS:-regional-compile,cache-dit+fp8+compile,hookkit-fp8+compile+flashinfer-attention,\
hookkit-fp8+compile+flashinfer-fp8-attention,hookkit-fp8+cache-fast+compile+fp8-attention,\
hookkit-fp8+cache-fast+compile+flashinfer-fp8-attention}
MODEL=wan ARCH=wan2.1-14b CONFIGS=$rows RUNS=$runs ROW_TIMEOUT=$row_timeout exec bash "$(dirname "$0")/video-rows.sh"
