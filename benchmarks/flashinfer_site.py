"""Build `.whl/flashinfer-site.tar.gz` for the GPU machine, where nothing can be installed: FlashInfer's Python package
and the sources its JIT compiles (its CUDA templates, CUTLASS's and spdlog's headers), laid out as an installed
`flashinfer-python` is, from the PyPI sdist of `flashinfer-python==VERSION` (default 0.2.14.post1, the oldest release
`Attention(low_precision="flashinfer_fp8")` takes: its sdist is 3.6 MB, a wheel of a newer release over 100 MB, more
than a device call carries). cuRAND's headers, which CUTLASS's utilities include, go beside FlashInfer's own, from the
`nvidia-curand` wheel. `benchmarks/gpu_env.sh` unpacks the archive into the GPU machine's site folder.

With `--aot-python`, the archive also holds the kernels hookkit calls prebuilt (FlashInfer's "AOT" folder,
`flashinfer/data/aot/<module>/<module>.so`, which it loads instead of compiling): FA3 for sm_90a, e4m3 and bf16 inputs,
bf16 output, heads of `--aot-heads`. nvcc compiles them here, against the torch the GPU machine has (2.11.0, the CUDA
13.0 build PyPI serves; give a Python 3.12 that has it): minutes here, none of the GPU's. `gpu_env.sh` loads each one
there first and removes any that does not load, which FlashInfer then compiles at first use as before.

    python benchmarks/flashinfer_site.py                  # here, once; then carry .whl in the device call
    python benchmarks/flashinfer_site.py --version 0.2.14.post1 --out .whl/flashinfer-site.tar.gz
    python3.12 -m venv /tmp/torch211 && /tmp/torch211/bin/pip install torch==2.11.0 ninja numpy jinja2 requests
    python benchmarks/flashinfer_site.py --aot-python /tmp/torch211/bin/python   # with the kernels prebuilt

pip prepares the sdist's metadata, which imports torch: run it with an interpreter that has torch (the checkout's
.venv). The prebuilt kernels need CUDA 13.0's nvcc (CUDA_HOME, default /usr/local/cuda).
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--aot-python", type=Path, default=None,
                   help="a Python with the GPU machine's torch: prebuild the kernels hookkit calls with it")
    p.add_argument("--aot-heads", default="64,128", help="head sizes to prebuild (default 64,128)")
    p.add_argument("--build-aot-into", type=Path, default=None, help=argparse.SUPPRESS)  # the step --aot-python runs
    args = p.parse_args(argv)
    if args.aot_python is not None and not args.aot_python.is_file():
        p.error(f"--aot-python: expected a Python interpreter, got {args.aot_python} (no such file)")
    return args


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


def build_aot(package: Path, heads: list[int]) -> None:
    """Run by the `--aot-python` interpreter, with `package`'s parent on its path: build FlashInfer's FA3
    single-sequence modules hookkit calls (e4m3 and bf16 inputs, bf16 output, no positional encoding, sliding window,
    soft cap or fp16 Q·Kᵀ reduction: what `single_prefill_with_kv_cache` asks for with hookkit's arguments), copy each
    into the package's AOT folder and load it, which fails here when it would fail there (a torch it was not built
    against)."""
    import torch
    from flashinfer.jit.attention.pytorch import gen_single_prefill_module

    for head in heads:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            spec = gen_single_prefill_module("fa3", dtype, dtype, torch.bfloat16, head, head, 0, False, False, False)
            spec.build(verbose=False)
            target = package / "data" / "aot" / spec.name / f"{spec.name}.so"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(spec.jit_library_path, target)
            torch.ops.load_library(str(target))
            print(f"built {spec.name}.so: {target.stat().st_size / 2**20:.1f} MiB", flush=True)


def aot_env(python: Path, package: Path, work: Path) -> dict[str, str]:
    """The environment FlashInfer's JIT builds modules in for the GPU machine: `package` importable, its workspace
    under `work`, sm_90a, CUDA_HOME's nvcc (default /usr/local/cuda) and `python`'s folder first on the PATH."""
    env = {**os.environ, "PYTHONPATH": str(package.parent), "FLASHINFER_WORKSPACE_BASE": str(work / "jit"),
           "TORCH_CUDA_ARCH_LIST": "9.0a", "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env['CUDA_HOME']}/bin{os.pathsep}{env.get('PATH', '')}"
    return env


def prebuild(python: Path, package: Path, heads: str, work: Path) -> None:
    """`build_aot` in `python` (the GPU machine's torch), for sm_90a, its JIT workspace under `work`."""
    subprocess.run([str(python), __file__, "--build-aot-into", str(package), "--aot-heads", heads],
                   env=aot_env(python, package, work), check=True)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.build_aot_into is not None:
        build_aot(args.build_aot_into, [int(h) for h in args.aot_heads.split(",")])
        return args.build_aot_into
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "sdist-dl").mkdir()
        (work / "curand-dl").mkdir()
        sdist = download(f"flashinfer-python=={args.version}", work / "sdist-dl", "--no-binary", "flashinfer-python")
        curand = download("nvidia-curand", work / "curand-dl", "--only-binary", ":all:", "--python-version", "3.12",
                          "--platform", "manylinux_2_27_x86_64")
        package = lay_out(sdist, curand, work / "site")
        if args.aot_python is not None:
            prebuild(args.aot_python, package, args.aot_heads, work)
        with tarfile.open(args.out, "w:gz") as tar:
            tar.add(package, arcname="flashinfer")
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")
    return args.out


if __name__ == "__main__":
    main()
