#!/usr/bin/env bash
# FlashInfer's FA3 e4m3 kernel with other tiles (benchmarks/flashinfer_fp8_tiles.py) beside its own and cuDNN SDPA at
# Wan 2.1 14B's shape (40 heads x 128, 32,760 tokens): one process a tile, each with cuDNN and FlashInfer's own tile in
# a process before them; the kernel alone and with hookkit's quantization (V smoothed). tiles_<tile>.json and .log,
# tiles_stock.json. Settings: TILES (the folder of built tiles, default $WHL/flashinfer-fp8-tiles, WHL: the .whl of
# the checkout the queue was started from: copy it to /tmp and set TILES when later calls may replace the tree), T_TILE
# (seconds a process, 300).
source "$(dirname "$0")/../suite_lib.sh"
TILES=${TILES:-${WHL:-.whl}/flashinfer-fp8-tiles}
KERNELS="sdpa_cudnn flashinfer_fp8_kernel flashinfer_fp8"
# shellcheck disable=SC2086 # KERNELS is a word list
kernel_times tiles_stock "${T_TILE:-300}" $KERNELS  # FlashInfer's own tile, q128kv192s2
for dir in "$TILES"/*/; do
  # shellcheck disable=SC2086
  kernel_times "tiles_$(basename "$dir")" "${T_TILE:-300}" $KERNELS -- --flashinfer-aot "$dir"
done
