#!/usr/bin/env bash
# FA3's e4m3 kernel built with another ptxas or tile (benchmarks/fa3_variants.py) beside its stock build and cuDNN.
# 40 heads x 128, 32,760 tokens, as the attention-fa3 suite: does ptxas 12.8 or a tile other than 128 x 224 take the
# kernel past 1.6x cuDNN? One process per build (each unpacked into its own folder, first on PYTHONPATH: every build is
# the module flash_attn_3), cuDNN again in each. Builds: $WHL/fa3-site.tar.gz ("stock"; WHL: the .whl of the checkout
# the queue was started from) and every $FA3_VARIANTS/NAME.tar.gz (default $WHL/fa3-variants: carry it;
# fa3_variants.py writes each build's fa3-site.tar.gz, copied there as NAME.tar.gz). attention_fa3_NAME.json and .log.
# ~10 GPU seconds a build. Settings: FA3_VARIANTS, T_FA3 (seconds a build, 300).
source "$(dirname "$0")/../suite_lib.sh"
whl=${WHL:-.whl}
builds=()
[ -f "$whl/fa3-site.tar.gz" ] && builds+=("$whl/fa3-site.tar.gz")
for f in "${FA3_VARIANTS:-$whl/fa3-variants}"/*.tar.gz; do [ -f "$f" ] && builds+=("$f"); done
if [ "${#builds[@]}" = 0 ]; then
  note "no FA3 build: $whl/fa3-site.tar.gz and ${FA3_VARIANTS:-$whl/fa3-variants}/*.tar.gz are missing"
  exit 1
fi
for tarball in "${builds[@]}"; do
  name=$(basename "$tarball" .tar.gz)
  [ "$name" = fa3-site ] && name=stock
  site="$OUT/site-$name"
  mkdir -p "$site" && tar xzf "$tarball" -C "$site" || { note "$name: could not unpack $tarball"; continue; }
  PYTHONPATH="$site:${PYTHONPATH:-}" kernel_times "attention_fa3_$name" "${T_FA3:-300}" sdpa_cudnn fa3_fp8_kernel
  rm -rf "$site"
done
