#!/usr/bin/env bash
# Wan 2.2 A14B (two experts), 480x832, 81 frames: hookkit's fastest beside cache-dit's best on the same computed steps.
# The video-rows suite (benchmarks/suites/video-rows.sh) with MODEL=wan, ARCH=wan2.2-a14b and the rows ROWS names
# (default two: hookkit fp8 + DBCache "fast" + regional compile + fp8 attention, and cache-dit + its fp8 + regional
# compile; stock eager is added as the reference unless NO_EAGER=1). Both libraries count each expert's steps from 0 on
# the "fast" mask, so both compute the same steps. ~10 GPU minutes on one H200 at 6 steps (cache-dit's first call,
# compiling two experts, is about 4 of them); at STEPS=50 about 16 on an H100 (estimated from Wan 2.1 14B's 50-step
# rows: cache-dit's about 550 s, give ROW_TIMEOUT=1100). Settings: ROWS, RUNS, ROW_TIMEOUT and NO_EAGER as
# video-rows.sh takes them; HEIGHT, WIDTH, FRAMES, STEPS pass through.
runs=${RUNS:-"--runs 2 --warmup 1"} row_timeout=${ROW_TIMEOUT:-600}  # before the shared defaults
source "$(dirname "$0")/../suite_lib.sh"
rows=${ROWS:-hookkit-fp8+cache-fast+compile+fp8-attention,cache-dit+fp8+compile}
MODEL=wan ARCH=wan2.2-a14b CONFIGS=$rows RUNS=$runs ROW_TIMEOUT=$row_timeout exec bash "$(dirname "$0")/video-rows.sh"
