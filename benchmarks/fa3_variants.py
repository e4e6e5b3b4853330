"""Build variants of `fa3-site.tar.gz` (see fa3_site.py): FA3's e4m3 hdim-128 forward with another ptxas or tile.

Why: at 32,760 tokens, 40 heads x 128, non-causal, FA3's own e4m3 kernel (built by fa3_site.py with nvcc/ptxas 13.0)
takes 24.18 ms on an H100, 1.546x cuDNN SDPA's 37.38 ms; the goal is 1.6x (about 23.4 ms). ptxas 13.0 reports small
register spills (12-28 bytes) in the hdim-128 kernels, FA3's setup.py says ptxas 12.8 gives the best performance,
and FA3's tile for fp8 hdim 128 (128 x 224) is one choice among several. Each variant answers one question: does
ptxas 12.8 or another tile take FA3's e4m3 kernel past 1.6x cuDNN at 32,760 tokens?

Variants (--variant):

    ptxas128     the same sources, ptxas 12.8.93 (FA3's NVIDIA_TOOLCHAIN_VERSION) behind nvcc 13.0. nvcc has no
                 ptxas-path flag and runs the ptxas next to it (nvcc.profile puts its own bin/ first on PATH), so
                 this builds a CUDA_HOME overlay: CUDA 13.0 symlinked, bin/nvcc and nvcc.profile copied, bin/ptxas a
                 wrapper that runs ptxas 12.8 on a copy of each .ptx with `.version 9.0` rewritten to 8.7 (ptxas
                 12.8 knows PTX ISA up to 8.7; nvcc 13.0's cicc writes 9.0). Everything else (cicc, nvlink,
                 fatbinary, libcudart.so.13) stays CUDA 13.0. ptxas 12.8 comes from PyPI's
                 nvidia-cuda-nvcc-cu12==12.8.93 wheel (pass its bin/ptxas with --ptxas).
    tile128x256  tile_size_fwd_sm90 returns {128, 256, true, true} for element size 1, hdim 128, non-causal,
    tile128x192  {128, 192, true, true},
    tile192x128  {192, 128, true, true}, each only where none of causal, local, paged KV (non-TMA), V column-major,
                 softcap apply; every other case, bf16 included, keeps FA3's choice. The host (flash_api) calls the
                 same function with the same arguments, so its scheduler sees the same tile.
    ptxas128-<tile>  both: the tile patch, built with ptxas 12.8.

    python benchmarks/fa3_variants.py --variant ptxas128 --ptxas /tmp/fa3/pt128/x/nvidia/cuda_nvcc/bin/ptxas \\
        --aot-python /tmp/torch211/bin/python \\
        --fa-git /work/.mirror/Dao-AILab+flash-attention/repo --cutlass-git /work/.mirror/NVIDIA+cutlass/repo

writes /tmp/fa3/variants/<variant>/: fa3-site.tar.gz (same layout as fa3_site.py's), patch.diff (what differs from
fa3_site.py's build), build.log (FA3's, with `--resource-usage` lines) and ptxas.txt (registers and spills of the
hdim-128 forward kernels, from that log).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fa3_site  # noqa: E402

TILES = {"tile128x256": (128, 256), "tile128x192": (128, 192), "tile192x128": (192, 128)}
VARIANTS = ("ptxas128", *TILES, *(f"ptxas128-{tile}" for tile in TILES))

#: FA3's fp8 hdim<=128 line of tile_size_fwd_sm90 (0251105a2fb1)
FP8_HDIM128 = ("            return {128, paged_kv_non_TMA ? 160 : (v_colmajor || (softcap && is_local) ? 192 : 224), "
               "true, true};\n")

WRAPPER = r'''#!/bin/bash
# ptxas 12.8 behind nvcc 13.0: nvcc 13.0's cicc writes PTX ISA 9.0, which ptxas 12.8 (ISA <= 8.7) refuses;
# rewrite the .version line of each input .ptx to 8.7 in a copy, then run ptxas 12.8 on the copy.
REAL="$(dirname "$(readlink -f "$0")")/../ptxas-12.8/ptxas"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
args=()
for a in "$@"; do
  if [[ "$a" == *.ptx && -f "$a" ]]; then
    c="$tmp/$(basename "$a")"; sed -E '0,/^\.version [0-9.]+/s//.version 8.7/' "$a" > "$c"; args+=("$c")
  else args+=("$a"); fi
done
"$REAL" "${args[@]}"
'''


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--ptxas", type=Path, default=None,
                   help="ptxas 12.8 (bin/ptxas of the nvidia-cuda-nvcc-cu12==12.8.93 wheel); for ptxas128")
    p.add_argument("--variants-dir", type=Path, default=Path("/tmp/fa3/variants"))
    mine, rest = p.parse_known_args(argv)
    if mine.variant.startswith("ptxas128") and (mine.ptxas is None or not mine.ptxas.is_file()):
        p.error("--variant ptxas128 needs --ptxas PATH (pip download --no-deps nvidia-cuda-nvcc-cu12==12.8.93, "
                "unzip, nvidia/cuda_nvcc/bin/ptxas)")
    folder = mine.variants_dir / mine.variant
    if "--out" not in rest:
        rest += ["--out", str(folder / "fa3-site.tar.gz")]
    return mine, fa3_site.parse_args(rest)


def cuda_overlay(ptxas: Path, into: Path) -> Path:
    """A CUDA_HOME whose nvcc runs `ptxas` (through WRAPPER) and is otherwise CUDA_HOME's CUDA 13.0."""
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")).resolve()
    (into / "bin").mkdir(parents=True)
    for entry in cuda.iterdir():
        if entry.name != "bin":
            (into / entry.name).symlink_to(entry)
    for entry in (cuda / "bin").iterdir():
        if entry.name in ("nvcc", "nvcc.profile"):
            shutil.copy2(entry, into / "bin" / entry.name)  # nvcc finds ptxas, cicc etc. relative to itself
        elif entry.name != "ptxas":
            (into / "bin" / entry.name).symlink_to(entry)
    (into / "ptxas-12.8").mkdir()
    shutil.copy2(ptxas, into / "ptxas-12.8" / "ptxas")
    (into / "ptxas-12.8" / "ptxas").chmod(0o755)
    (into / "bin" / "ptxas").write_text(WRAPPER)
    (into / "bin" / "ptxas").chmod(0o755)
    version = subprocess.run([str(into / "ptxas-12.8" / "ptxas"), "--version"], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-2]
    print(f"ptxas: {version}", flush=True)
    return into


def patch_tile(hopper: Path, tile: tuple[int, int]) -> str:
    """Patch tile_size.h for the fp8 hdim-128 non-causal case; returns the unified diff."""
    path = hopper / "tile_size.h"
    before = path.read_text()
    if before.count(FP8_HDIM128) != 1:
        raise RuntimeError(f"expected FA3's fp8 hdim-128 line once in {path}; this FA3 differs from 0251105a2fb1")
    new = ("            if (!is_causal && !is_local && !paged_kv_non_TMA && !v_colmajor && !softcap) {\n"
           f"                return {{{tile[0]}, {tile[1]}, true, true}};  // hookkit fa3_variants.py\n"
           "            }\n")
    after = before.replace(FP8_HDIM128, new + FP8_HDIM128)
    path.write_text(after)
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        "a/hopper/tile_size.h", "b/hopper/tile_size.h"))


KERNEL = re.compile(r"Function properties for "
                    r"(_ZN7cutlass13device_kernelIN5flash11enable_sm90INS1_16FlashAttnFwdSm90\S*)")


def resource_lines(log: Path) -> str:
    """The forward kernels' `--resource-usage` lines from FA3's build log: tile, dtype, causal, scheduler, spills."""
    lines = log.read_text(errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines):
        match = KERNEL.search(line)
        if not match:
            continue
        name = match.group(1)
        tile = (re.search(r"NS6_IJNS7_ILi(\d+)EEENS7_ILi(\d+)EEE", name)
                or re.search(r"ILi(\d+)EEENS\d*_ILi(\d+)EEE", name))
        dtype = "e4m3" if "float_e4m3_t" in name else "bf16"
        flags = re.search(r"NS_4arch4Sm90E((?:Lb[01]E)+)", name)
        causal = flags and flags.group(1).startswith("Lb1")
        sched = re.search(r"NS1_\d+(StaticPersistent|DynamicPersistent|SingleTile|VarlenDynamicPersistent)"
                          r"\w*?TileScheduler", name)
        spill = next((l.strip() for l in lines[i + 1:i + 3] if "spill" in l), "?")
        regs = next((re.search(r"Used \d+ registers", l).group(0) for l in lines[i + 1:i + 4]
                     if re.search(r"Used \d+ registers", l)), "?")
        out.append(f"{dtype} {'causal' if causal else 'non-causal'} tile {tile.group(1) if tile else '?'}x"
                   f"{tile.group(2) if tile else '?'} {sched.group(1) if sched else '?'} cluster="
                   f"{'2' if 'NS5_1CILi2EEENS7_ILi1EEES9_' in name else '1'}: {regs}, {spill}\n    {name}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> Path:
    mine, args = parse_args(argv)
    folder = mine.variants_dir / mine.variant
    folder.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"fa3-{mine.variant}-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        if work.exists() and any(work.iterdir()):
            raise RuntimeError(f"--work: expected an empty or new folder, got {work} (not empty); remove it")
        src = work / "src"
        fa_commit, cutlass_commit = fa3_site.lay_out(args, src)
        print(f"flash-attention {fa_commit}, CUTLASS {cutlass_commit}", flush=True)
        diff = ""
        tile = mine.variant.removeprefix("ptxas128").removeprefix("-")
        if tile:
            diff += patch_tile(src / "hopper", TILES[tile])
        if mine.variant.startswith("ptxas128"):
            overlay = cuda_overlay(mine.ptxas.resolve(), work / "cuda-ptxas128")
            os.environ["CUDA_HOME"] = str(overlay)
            diff += ("# CUDA_HOME is an overlay of CUDA 13.0 whose bin/ptxas is this wrapper around\n"
                     "# ptxas 12.8.93 (nvidia-cuda-nvcc-cu12==12.8.93), copied to <overlay>/ptxas-12.8/ptxas\n"
                     + "".join(difflib.unified_diff([], WRAPPER.splitlines(True), "/dev/null",
                                                    "b/<overlay>/bin/ptxas")))
        (folder / "patch.diff").write_text(diff)
        env = fa3_site.build_env(args.aot_python, src, args.jobs)
        fa3_site.check_toolchain(args.aot_python, env)
        try:
            module = fa3_site.build(args.aot_python, src / "hopper", env)
        finally:
            log = src / "hopper" / "build.log"
            if log.exists():
                shutil.copyfile(log, folder / "build.log")
                (folder / "ptxas.txt").write_text(resource_lines(log))
        fa3_site.pack(src / "hopper", module, work / "site", out)
        fa3_site.check_import(args.aot_python, out, work)
    minutes, seconds = divmod(int(time.monotonic() - start), 60)
    print(f"{out}: {out.stat().st_size / 2**20:.2f} MiB, {minutes} min {seconds} s in all", flush=True)
    print((folder / "ptxas.txt").read_text(), flush=True)
    return out


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        sys.exit(f"fa3_variants: {error}")
