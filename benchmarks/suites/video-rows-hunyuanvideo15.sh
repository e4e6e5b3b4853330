#!/usr/bin/env bash
# HunyuanVideo 1.5 (480p, 8.3B), 480x832, 81 frames: hookkit's fastest beside cache-dit's best, same computed steps.
# The video-rows suite (benchmarks/suites/video-rows.sh) with MODEL=hunyuanvideo15 and the rows ROWS names (default:
# hookkit fp8 + DBCache "fast" + regional compile with hookkit's fp8 attention kernel and with bf16 attention, and
# cache-dit + its fp8 + regional compile; stock eager is added as the reference), each on the same static "fast"
# computed steps. The fp8 attention row once returned NaN: torchao's fp8 made the padding queries' zero rows NaN,
# fixed by bounding its amax below (BENCHMARKS.md). Whole-transformer graphs are refused on this model (its forward
# syncs with the host). Settings: ROWS (comma-separated rows), RUNS and ROW_TIMEOUT as video-rows.sh takes them;
# HEIGHT, WIDTH, FRAMES, STEPS pass through. ~22 GPU minutes on one H200, more than one device call (collect in a
# later call): cache-dit's row compiles for more than 420 s on this model (an H100 ended it there), so a row may take
# 900 s here at 6 steps. At STEPS=50 cache-dit's row takes about 1,000 s on an H100 (a first call of about 600 s and two
# of about 160; estimated from the 6-step row), hookkit's about 270: give ROW_TIMEOUT=1500.
runs=${RUNS:-"--runs 2 --warmup 1"} row_timeout=${ROW_TIMEOUT:-900}  # before the shared defaults
source "$(dirname "$0")/../suite_lib.sh"
rows=${ROWS:-hookkit-fp8+cache-fast+compile+fp8-attention,hookkit-fp8+cache-fast+compile,cache-dit+fp8+compile}
MODEL=hunyuanvideo15 ARCH=hunyuanvideo1.5-480p CONFIGS=$rows RUNS=$runs ROW_TIMEOUT=$row_timeout \
  exec bash "$(dirname "$0")/video-rows.sh"
