#!/usr/bin/env bash
# fp8 quantization variants of Flux-dev against bf16, under regional compile.
# benchmarks/quant_flux.py: quant_flux_SIZE.json, its table in suite.log. Settings: QUANT_VARIANTS (comma-separated;
# default bf16-regional and four fp8-regional forms), QUANT_SIZE (1024; at 512 e.g.
# QUANT_VARIANTS=bf16-regional,fp8-regional,fp8-ro,fp8-graph), T_QUANT_FLUX (seconds, 1800).
source "$(dirname "$0")/../suite_lib.sh"
timeout "${T_QUANT_FLUX:-1800}" python3 benchmarks/quant_flux.py --size "${QUANT_SIZE:-1024}" \
  --variants "${QUANT_VARIANTS:-bf16-regional,fp8-regional,fp8-regional+fused,fp8-regional+mod,fp8-regional+fused+mod}"
note "quant_flux rc $?"
