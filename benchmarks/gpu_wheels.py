"""Fill `.whl` with the wheels the GPU machine lacks, for `carry: [".whl"]` in device calls.

The GPU machine reaches no package index; `benchmarks/gpu_env.sh` installs what `.whl` holds there. This downloads
diffusers, torchao, loguru and cache-dit at the versions BENCHMARKS.md's numbers were taken with, built for the GPU
machine's Python 3.12 (pure-Python or abi3 wheels), and with `--flashinfer` builds FlashInfer's site archive
(`benchmarks/flashinfer_site.py`: its sources, no prebuilt kernels). `.whl` is git-ignored: a new checkout needs it
again.

    python benchmarks/gpu_wheels.py                 # here, with pip and PyPI; then carry .whl
    python benchmarks/gpu_wheels.py --flashinfer    # also .whl/flashinfer-site.tar.gz
    python benchmarks/gpu_wheels.py --print         # the commands, run nothing
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the packages the GPU machine's image lacks, at the versions of BENCHMARKS.md's numbers
PACKAGES = ("diffusers==0.42.1", "torchao==0.17.0", "loguru==0.7.3", "cache-dit==1.5.3")
#: the GPU machine's interpreter and the platforms its pip accepts
TARGET = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
          "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform",
          "manylinux2014_x86_64")


def commands(whl: Path, flashinfer: bool) -> list[list[str]]:
    """The commands that fill `whl`: pip's download of `PACKAGES`, then with `flashinfer` the site archive's build."""
    out = [[sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *TARGET, "-d",
            str(whl), *PACKAGES]]
    if flashinfer:
        out.append([sys.executable, str(ROOT / "benchmarks" / "flashinfer_site.py"), "--out",
                    str(whl / "flashinfer-site.tar.gz")])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--whl", type=Path, default=ROOT / ".whl", help="the folder to fill (default: the checkout's .whl)")
    p.add_argument("--flashinfer", action="store_true", help="also build .whl/flashinfer-site.tar.gz")
    p.add_argument("--print", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    todo = commands(args.whl, args.flashinfer)
    if args.print:
        for command in todo:
            print(" ".join(command))
        return 0
    args.whl.mkdir(parents=True, exist_ok=True)
    for command in todo:
        subprocess.run(command, check=True)
    print("\n".join(sorted(path.name for path in args.whl.iterdir())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
