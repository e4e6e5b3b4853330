"""Build FlashInfer's FA3 e4m3 kernel for heads of 128 with other tiles, to time each on the GPU
(`benchmarks/suites/attention-flashinfer-tiles.sh`): does another tile than FlashInfer's 128 x 192, 2 stages, bring
its fp8 kernel to 1.6x cuDNN at Wan 2.1 14B's shape?

Each tile is `qQkvKsS`: Q rows a CTA (a multiple of 64: one consumer warpgroup each 64), K/V rows a stage (a multiple
of 64: FlashInfer transposes V in 64 x 64 blocks) and pipeline stages. For each, a copy of the FlashInfer package in
`.whl/flashinfer-site.tar.gz` (benchmarks/flashinfer_site.py) gets that tile in its single-sequence fp8 dispatch for
heads of 128 (`hopper/quantization/prefill_sm90.cuh`), and nvcc builds the module hookkit calls from it, against the
GPU machine's torch, as `--aot-python` does in `flashinfer_site.py`. Out: `OUT/<tile>/<module>/<module>.so`, the
layout of FlashInfer's prebuilt folder: `attention_kernels.py --flashinfer-aot OUT/<tile>` loads it.

    python benchmarks/flashinfer_fp8_tiles.py --aot-python /tmp/torch211/bin/python q128kv256s2 q128kv128s3

Minutes of nvcc a tile here (two cores: about 7), none of the GPU's. Measurement only: hookkit runs FlashInfer's own
tiles.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.flashinfer_site import aot_env  # noqa: E402 - under a folder of sys.path

#: the dispatch FlashInfer 0.2.14.post1 has for heads of 128 in its single-sequence fp8 kernel
_INDENT = "\n" + " " * 33  # the header's alignment of the traits' arguments
DISPATCH = _INDENT.join(("/*CTA_Q_=*/{},", "/*CTA_KV_=*/{},", "/*NUM_STAGES_=*/{},"))
STOCK = DISPATCH.format(128, 192, 2)
HEADER = "include/flashinfer/attention/hopper/quantization/prefill_sm90.cuh"
TILE = re.compile(r"q(\d+)kv(\d+)s(\d+)")

BUILD = """
import shutil, sys, torch
from flashinfer.jit.attention.pytorch import gen_single_prefill_module
spec = gen_single_prefill_module("fa3", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, 128, 128, 0, False,
                                 False, False)
spec.build(verbose=True)
target = f"{sys.argv[1]}/{spec.name}/{spec.name}.so"
__import__("os").makedirs(target.rsplit("/", 1)[0], exist_ok=True)
shutil.copyfile(spec.jit_library_path, target)
torch.ops.load_library(target)
print(target)
"""


def tile(text: str) -> tuple[int, int, int]:
    """`qQkvKsS` as (Q rows, K/V rows, stages), each checked as FlashInfer's fp8 traits need them."""
    m = TILE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a tile like q128kv256s2, got {text!r}")
    cta_q, cta_kv, stages = (int(x) for x in m.groups())
    if cta_q % 64 or cta_kv % 64 or not 1 <= stages <= 4:
        raise argparse.ArgumentTypeError(f"{text}: Q and K/V rows must be multiples of 64, stages 1-4")
    return cta_q, cta_kv, stages


def patch(header: Path, cta_q: int, cta_kv: int, stages: int) -> None:
    """Put the tile in the single-sequence dispatch for heads of 128 (the first branch of that size after
    `SingleFP8PrefillWithKVCacheDispatched`); fails when the header is not the one this script knows."""
    text = header.read_text()
    dispatch = text.index("cudaError_t SingleFP8PrefillWithKVCacheDispatched")
    start = text.index("if constexpr (HEAD_DIM == 128)", dispatch)
    at = text.find(STOCK, start)
    if at < 0 or at - start > 400:
        raise SystemExit(f"{header}: FlashInfer's fp8 dispatch for heads of 128 is not the one this script patches")
    header.write_text(text[:at] + DISPATCH.format(cta_q, cta_kv, stages) + text[at + len(STOCK):])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tiles", nargs="+", help="tiles to build, e.g. q128kv256s2")
    p.add_argument("--aot-python", type=Path, required=True, help="a Python with the GPU machine's torch")
    p.add_argument("--site", type=Path, default=ROOT / ".whl" / "flashinfer-site.tar.gz")
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "flashinfer-fp8-tiles")
    args = p.parse_args(argv)
    for name in args.tiles:
        tile(name)  # every name checked before the first build
    if not args.site.is_file():
        p.error(f"--site: expected FlashInfer's site archive (benchmarks/flashinfer_site.py), got {args.site}")
    for name in args.tiles:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            with tarfile.open(args.site) as tar:
                tar.extractall(work / "site", filter="data")
            shutil.rmtree(work / "site" / "flashinfer" / "data" / "aot", ignore_errors=True)
            patch(work / "site" / "flashinfer" / "data" / HEADER, *tile(name))
            env = aot_env(args.aot_python, work / "site" / "flashinfer", work)
            out = args.out / name
            shutil.rmtree(out, ignore_errors=True)
            r = subprocess.run([str(args.aot_python), "-c", BUILD, str(out)], env=env, capture_output=True, text=True)
            (args.out / f"{name}.log").write_text(r.stdout + r.stderr)
            print(f"{name}: {'built' if r.returncode == 0 else 'failed'} (log: {args.out / name}.log)", flush=True)
            if r.returncode != 0:
                shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
