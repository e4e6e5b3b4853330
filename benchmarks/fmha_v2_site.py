"""Build `.whl/fmha-v2-site.tar.gz` for the GPU machine: TensorRT-LLM's FMHA v2 attention for Hopper, prebuilt.

Why: FlashInfer's FA3 e4m3 kernel reaches 1.50x cuDNN at Wan 2.1 14B's attention shape, short of the 1.6x goal;
FlashInfer's newer releases also ship TensorRT-LLM's FMHA v2 (`flashinfer.prefill.trtllm_fmha_v2_prefill`), whose
Hopper e4m3 kernels its developers report at 1.1-1.3 PFLOP/s on an H200. Importing those releases needs far more
than a device call carries (the wheel is 101 MB), so this builds only the kernels and their entry point, here:

- the sources, from the `flashinfer-python==VERSION` wheel on PyPI (default 0.7.4): FMHA v2's CUDA templates, its
  kernel generator (FlashInfer's Python, run here) and its `run` entry point (`fmha_v2_run.cu`, a TVM-FFI function);
- two kernels per head size of `--heads`, warp-specialised with TMA for sm_90a: e4m3 Q, K, V packed
  `[tokens, 3, heads, head]` with bf16 output, and bf16 Q, K, V as separate `[tokens, heads, head]` tensors; each with
  its padding (non-causal), causal, sliding-window and custom-mask variants; no logit softcap, softmax statistics,
  skip-softmax or ALiBi;
- nvcc (CUDA 13.0, CUDA_HOME, default /usr/local/cuda) compiles them into `fmha_v2/fmha_v2_sm90.so`, linked against
  libcudart.so.13 (the one torch's CUDA 13 build loads); cuBLAS's headers come from `--python`'s nvidia packages;
- `tvm_ffi` from the `apache-tvm-ffi` wheel (cp312, its runtime only), which loads the module and passes torch
  tensors to it: `tvm_ffi.load_module(path).run(...)`.

    python3.12 -m venv /tmp/torch211 && /tmp/torch211/bin/pip install torch==2.11.0 jinja2
    python benchmarks/fmha_v2_site.py --python /tmp/torch211/bin/python       # then carry .whl in the device call

`benchmarks/gpu_env.sh` unpacks the archive into the GPU machine's site folder; `benchmarks/attention_kernels.py`
times the kernels as `fmha_v2_fp8`, `fmha_v2_fp8_kernel` and `fmha_v2_bf16`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.flashinfer_site import download  # noqa: E402
#: the module's path inside the archive (and in the site folder it is unpacked into)
MODULE = "fmha_v2/fmha_v2_sm90.so"
#: what the build takes from the flashinfer-python wheel: FMHA v2's sources, FlashInfer's headers it includes, and the
#: Python of its kernel generator with the modules that imports
SOURCES = ("flashinfer/data/csrc/fmha_v2/", "flashinfer/data/csrc/fmha_v2_run.cu",
           "flashinfer/data/csrc/fmha_v2_jit_binding.cu", "flashinfer/data/csrc/tvm_ffi_utils.h",
           "flashinfer/data/include/", "flashinfer/jit/attention/fmha_v2/", "flashinfer/jit/env.py",
           "flashinfer/jit/_cuda_architecture.py", "flashinfer/jit/utils.py", "flashinfer/compilation_context.py",
           "flashinfer/version.py")
#: what the archive leaves out of the apache-tvm-ffi wheel: what builds against it (headers, sources, CMake), not what
#: runs (its Python extension needs both of its libraries)
TVM_FFI_SKIP = ("tvm_ffi/include/", "tvm_ffi/3rdparty/", "tvm_ffi/src/", "tvm_ffi/cython/", "tvm_ffi/cmake/",
                "tvm_ffi/share/")
#: the generator step, run by `--python` (it imports torch): writes each kernel's source and the dispatch header
GENERATE = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from flashinfer.jit.attention.fmha_v2 import fmha_library as lib
from flashinfer.jit.attention.fmha_v2.utils import InputLayout
out = Path(sys.argv[2])
kinds = (("e4m3", InputLayout.PACKED_QKV, "bf16"), ("bf16", InputLayout.SEPARATE_Q_K_V, None))
specs = []
for head in map(int, sys.argv[3].split(",")):
    for dtype, layout, output in kinds:
        spec = lib.generate_kernel_spec(sm=90, head_size=head, dtype=dtype, enable_skip_softmax=False,
                                        return_softmax=False, enable_attn_logit_softcapping=False, alibi=False,
                                        input_layout=layout, output_dtype=output)
        if not lib.is_kernel_spec_valid(spec):
            raise SystemExit(f"FMHA v2 has no {dtype} kernel for heads of {head}")
        fname, lname, kname = lib.encode_name(spec)
        (out / fname).write_text(lib.get_kernel_code(spec, kname, lname))
        specs.append((spec, fname, lname, kname))
        print(fname)
(out / "fmha_v2_api.h").write_text(lib.get_api_code(specs))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", type=Path, required=True,
                   help="a Python 3.12 with the GPU machine's torch (2.11.0 from PyPI) and jinja2: runs the kernel "
                        "generator and gives cuBLAS's headers")
    p.add_argument("--version", default="0.7.4", help="flashinfer-python release whose sources to build (a wheel)")
    p.add_argument("--tvm-ffi", default="apache-tvm-ffi>=0.1.11,<0.2", help="the apache-tvm-ffi requirement")
    p.add_argument("--heads", default="128", help="head sizes, comma-separated (default 128: Wan's)")
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "fmha-v2-site.tar.gz")
    args = p.parse_args(argv)
    if not args.python.is_file():
        p.error(f"--python: expected a Python interpreter, got {args.python} (no such file)")
    try:
        heads = [int(h) for h in args.heads.split(",")]
    except ValueError:
        p.error(f"--heads: expected comma-separated head sizes, got {args.heads!r}")
    if not heads or min(heads) < 1:
        p.error(f"--heads: expected positive head sizes, got {args.heads!r}")
    return args


def extract(wheel: Path, into: Path, keep: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
    """The members of `wheel` that start with one of `keep` (all where empty) and with none of `skip`."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if (keep and not name.startswith(keep)) or name.startswith(skip) or name.endswith("/"):
                continue
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))


def nvidia_include(python: Path) -> Path:
    """The `nvidia/cu13/include` folder of `python`'s site packages (cuBLAS's headers, which FMHA v2 includes)."""
    found = subprocess.run([str(python), "-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "
                            "'cu13', 'include'))"], check=True, capture_output=True, text=True).stdout.strip()
    if not (Path(found) / "cublasLt.h").is_file():
        raise SystemExit(f"--python: no cublasLt.h under {found}; install torch==2.11.0 from PyPI in it")
    return Path(found)


def nvcc_flags(src: Path, gen: Path, tvm_ffi: Path, cuda_include: Path) -> list[str]:
    dlpack = next(tvm_ffi.glob("3rdparty/**/dlpack/include"), tvm_ffi / "include")
    return ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
            "-static-global-template-stub=false", "--compiler-options=-fPIC", "-DPy_LIMITED_API=0x03090000",
            "-D_GLIBCXX_USE_CXX11_ABI=1", f"-I{src / 'fmha_v2'}", f"-I{gen}",
            "-isystem", str(src.parent / "include"), "-isystem", str(src), "-isystem", str(tvm_ffi / "include"),
            "-isystem", str(dlpack), "-isystem", str(cuda_include), "-Wno-deprecated-gpu-targets"]


def build(args: argparse.Namespace, work: Path) -> Path:
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    sources, tvm_build, site = work / "src", work / "tvm_build", work / "site"
    extract(download(f"flashinfer-python=={args.version}", work / "dl", "--only-binary", ":all:"), sources,
            keep=SOURCES)
    tvm_wheel = download(args.tvm_ffi, work / "dl-tvm", "--only-binary", ":all:", "--python-version", "3.12",
                         "--platform", "manylinux_2_28_x86_64")
    extract(tvm_wheel, tvm_build)
    gen = work / "gen"
    gen.mkdir()
    subprocess.run([str(args.python), "-c", GENERATE, str(sources), str(gen), args.heads], check=True)
    csrc = sources / "flashinfer" / "data" / "csrc"
    flags = nvcc_flags(csrc, gen, tvm_build / "tvm_ffi", nvidia_include(args.python))
    units = sorted(gen.glob("fmha_v2_flash_attention_*.cu")) + [csrc / "fmha_v2_run.cu",
                                                                 csrc / "fmha_v2_jit_binding.cu"]
    objects = []
    for unit in units:
        objects.append(gen / f"{unit.stem}.o")
        print(f"nvcc {unit.name}", flush=True)
        subprocess.run([str(nvcc), "-c", *flags, str(unit), "-o", str(objects[-1])], check=True)
    module = site / MODULE
    module.parent.mkdir(parents=True)
    subprocess.run([str(nvcc), "-shared", "-gencode=arch=compute_90a,code=sm_90a", *map(str, objects),
                    f"-L{nvcc.parent.parent / 'lib64'}", "-lcudart", "-o", str(module)], check=True)
    extract(tvm_wheel, site, keep=("tvm_ffi/",), skip=TVM_FFI_SKIP)
    return site


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = build(args, Path(tmp))
        with tarfile.open(args.out, "w:gz") as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    return args.out


if __name__ == "__main__":
    main()
