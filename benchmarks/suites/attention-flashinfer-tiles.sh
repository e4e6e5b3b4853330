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
rows_of() {  # rows_of LOG: the kernels' summary lines of one attention_kernels.py log, on one line
  grep -E '^(sdpa_cudnn|flashinfer_fp8)' "$1" | tr -s ' ' | cut -c1-80 | tr '\n' ';'
}
timeout "${T_TILE:-300}" python3 benchmarks/attention_kernels.py --heads 40 --kernels $KERNELS \
  --out "$OUT/tiles_stock.json" > "$OUT/tiles_stock.log" 2>&1
note "stock tile (q128kv192s2) rc $? $(rows_of "$OUT/tiles_stock.log")"
for dir in "$TILES"/*/; do
  name=$(basename "$dir")
  timeout "${T_TILE:-300}" python3 benchmarks/attention_kernels.py --heads 40 --kernels $KERNELS \
    --flashinfer-aot "$dir" --out "$OUT/tiles_$name.json" > "$OUT/tiles_$name.log" 2>&1
  note "$name rc $? $(rows_of "$OUT/tiles_$name.log")"
done
