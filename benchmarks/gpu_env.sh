# Sourced (never run) by the GPU scripts and queue.sh, so that a bare GPU machine,
# in this device call or a later one (a fresh shell), imports diffusers, torchao, loguru and cache-dit, and hookkit
# from the right checkout. Sourcing defines one function; calling it does the work:
#
#   source benchmarks/gpu_env.sh && gpu_env [REPO] || exit 1
#
# `gpu_env` exports PYTHONPATH=SITE:REPO (SITE: $GPU_SITE, default /tmp/site; REPO: the checkout to import hookkit
# from, default the one holding this file; a queue passes its snapshot) and PYTHONUNBUFFERED=1. When one of the four
# packages does not import, installs the wheels of $WHL (default: .whl of the checkout holding this file; carry it in
# the device call) into SITE, which stays for the machine's later calls. Returns 1, saying why, when they neither
# import nor install. When $WHL holds flashinfer-site.tar.gz (benchmarks/flashinfer_site.py builds it) and SITE has
# no flashinfer yet, unpacks it there first: FlashInfer's package and the sources its JIT compiles, and the kernels
# prebuilt for this machine's torch where it holds them; one that does not load here is removed (FlashInfer then
# compiles it at first use, as without it). Likewise fmha-v2-site.tar.gz (benchmarks/fmha_v2_site.py), when SITE has
# no fmha_v2 yet: TensorRT-LLM's FMHA v2 module prebuilt and the tvm_ffi package that loads it. Likewise
# fa3-site.tar.gz (benchmarks/fa3_site.py), when SITE has no flash_attn_3 yet: FlashAttention-3's own Hopper forward
# module prebuilt and its Python interface.

gpu_env() {  # gpu_env [REPO]
  local here repo whl site
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  repo=${1:-$here}
  site=${GPU_SITE:-/tmp/site}
  whl=${WHL:-$here/.whl}
  export PYTHONPATH="$site:$repo" PYTHONUNBUFFERED=1
  if [ -f "$whl/flashinfer-site.tar.gz" ] && [ ! -d "$site/flashinfer" ]; then
    mkdir -p "$site" && tar xzf "$whl/flashinfer-site.tar.gz" -C "$site" || {
      echo "gpu_env.sh: could not unpack $whl/flashinfer-site.tar.gz into $site" >&2
      return 1
    }
    python3 - "$site"/flashinfer/data/aot/*/*.so <<'PY'
import shutil, sys
from pathlib import Path
import torch
for so in map(Path, sys.argv[1:]):
    if not so.is_file():
        continue
    try:
        torch.ops.load_library(str(so))
    except Exception as exc:  # any failure to load: FlashInfer builds the module itself
        print(f"gpu_env.sh: prebuilt {so.name} does not load here ({str(exc).splitlines()[0][:200]}); "
              "FlashInfer compiles it at first use", file=sys.stderr)
        shutil.rmtree(so.parent)
PY
  fi
  if [ -f "$whl/fmha-v2-site.tar.gz" ] && [ ! -d "$site/fmha_v2" ]; then
    mkdir -p "$site" && tar xzf "$whl/fmha-v2-site.tar.gz" -C "$site" || {
      echo "gpu_env.sh: could not unpack $whl/fmha-v2-site.tar.gz into $site" >&2
      return 1
    }
  fi
  if [ -f "$whl/fa3-site.tar.gz" ] && [ ! -d "$site/flash_attn_3" ]; then
    mkdir -p "$site" && tar xzf "$whl/fa3-site.tar.gz" -C "$site" || {
      echo "gpu_env.sh: could not unpack $whl/fa3-site.tar.gz into $site" >&2
      return 1
    }
  fi
  python3 -c "import diffusers, torchao, loguru, cache_dit" 2>/dev/null && return 0
  if ! ls "$whl"/*.whl > /dev/null 2>&1; then
    echo "gpu_env.sh: diffusers, torchao, loguru and cache_dit do not all import and $whl holds no wheels;" \
      "carry .whl (or set WHL to a folder of wheels); python benchmarks/gpu_wheels.py fills .whl" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl"/*.whl || return 1
  python3 -c "import diffusers, torchao, loguru, cache_dit" || {
    echo "gpu_env.sh: installed the wheels of $whl into $site, but the packages still do not import" >&2
    return 1
  }
}
