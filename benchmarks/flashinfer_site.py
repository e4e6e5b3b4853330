"""Build `.whl/flashinfer-site.tar.gz` for the GPU machine, where nothing can be installed: FlashInfer's Python package
and the sources its JIT compiles (its CUDA templates, CUTLASS's and spdlog's headers), laid out as an installed
`flashinfer-python` is, from the PyPI sdist of `flashinfer-python==VERSION` (default 0.2.14.post1, the oldest release
`Attention(low_precision="flashinfer_fp8")` takes: its sdist is 3.6 MB, a wheel of a newer release over 100 MB, more
than a device call carries). cuRAND's headers, which CUTLASS's utilities include, go beside FlashInfer's own, from the
`nvidia-curand` wheel. `benchmarks/gpu_env.sh` unpacks the archive into the GPU machine's site folder.

    python benchmarks/flashinfer_site.py                  # here, once; then carry .whl in the device call
    python benchmarks/flashinfer_site.py --version 0.2.14.post1 --out .whl/flashinfer-site.tar.gz

pip prepares the sdist's metadata, which imports torch: run it with an interpreter that has torch (the checkout's
.venv).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: what the archive holds under flashinfer/data/, from the sdist's folders
DATA = {"csrc": "csrc", "include": "include", "tvm_binding": "tvm_binding",
        "cutlass/include": "3rdparty/cutlass/include",
        "cutlass/tools/util/include": "3rdparty/cutlass/tools/util/include",
        "spdlog/include": "3rdparty/spdlog/include"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default="0.2.14.post1", help="flashinfer-python release (an sdist on PyPI)")
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "flashinfer-site.tar.gz")
    return p.parse_args(argv)


def download(spec: str, into: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into), *extra, spec],
                   check=True)
    return max(into.iterdir(), key=lambda p: p.stat().st_mtime)


def lay_out(sdist: Path, curand_wheel: Path, site: Path) -> Path:
    """The sdist and cuRAND's headers as `site/flashinfer` (an installed flashinfer-python's layout)."""
    with tarfile.open(sdist) as tar:
        tar.extractall(site.parent / "sdist", filter="data")
    source = next((site.parent / "sdist").iterdir())
    package = site / "flashinfer"
    shutil.copytree(source / "flashinfer", package)
    for target, origin in DATA.items():
        if (source / origin).is_dir():
            shutil.copytree(source / origin, package / "data" / target)
    with zipfile.ZipFile(curand_wheel) as wheel:
        for name in wheel.namelist():
            if "/include/curand" in name and name.endswith(".h"):
                (package / "data" / "include" / Path(name).name).write_bytes(wheel.read(name))
    return package


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "sdist-dl").mkdir()
        (work / "curand-dl").mkdir()
        sdist = download(f"flashinfer-python=={args.version}", work / "sdist-dl", "--no-binary", "flashinfer-python")
        curand = download("nvidia-curand", work / "curand-dl", "--only-binary", ":all:", "--python-version", "3.12",
                          "--platform", "manylinux_2_27_x86_64")
        package = lay_out(sdist, curand, work / "site")
        with tarfile.open(args.out, "w:gz") as tar:
            tar.add(package, arcname="flashinfer")
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")
    return args.out


if __name__ == "__main__":
    main()
