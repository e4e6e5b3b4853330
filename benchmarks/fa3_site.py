"""Build `.whl/fa3-site.tar.gz` for the GPU machine: FlashAttention-3's own Hopper forward kernel, prebuilt.

Why: `Attention(low_precision="fa3_fp8")` runs FA3's own e4m3 forward kernel, the fastest attention hookkit has
measured at Wan 2.1 14B's shape (40 heads x 128, 32,760 tokens; BENCHMARKS.md), ahead of FlashInfer's port of it. It is
the `flash_attn_3` extension in the `hopper/` folder of Dao-AILab/flash-attention, with no wheel on PyPI. The GPU
machine has no nvcc and no internet, so nvcc compiles it here, against the torch the GPU machine has (2.11.0+cu130,
Python 3.12), and the archive carries the built module and its Python interface.

Only what we measure is compiled: the sm_90a forward for head dim 128, e4m3 inputs with bf16 output, and bf16 inputs
(FA3 always builds its bf16 kernel; it is the comparison we want anyway); causal and non-causal (FA3 cannot disable
causal), thread-block clusters kept (FA3's bf16 hdim-128 non-causal kernel uses them). Everything else is switched
off through FA3's setup.py, which reads these environment variables (all set to TRUE):

    FLASH_ATTENTION_DISABLE_{BACKWARD,SPLIT,PAGEDKV,APPENDKV,LOCAL,SOFTCAP,PACKGQA,FP16,VARLEN,
                             HDIM64,HDIM96,HDIM192,HDIM256,HDIMDIFF64,HDIMDIFF192,SM80}

and FLASH_ATTENTION_DISABLE_{FP8,HDIM128,CLUSTER}=FALSE, with MAX_JOBS=2, NVCC_THREADS=1 (to stay inside 23 GB of
memory), TORCH_CUDA_ARCH_LIST=9.0a, FLASH_ATTENTION_OFFLINE_BUILD=TRUE. That leaves four compile units
(flash_api_stable.cpp, flash_prepare_scheduler.cu and the two hdim-128 instantiations) and five kernels.

Built here with FA3 0251105a2fb1 (its hopper/ last changed in c75d019d) and the CUTLASS its submodule pins,
7127592069c2 (v4.3.0-48), nvcc 13.0.88, gcc 12.2: 2 min 38 s to 2 min 44 s on 2 CPU cores; the module is
2.8 MB after `strip --strip-debug`, the archive 0.51 MiB. Built on glibc 2.36, the module needs glibc 2.34 there
(dlopen, pthread_once), where FlashInfer's prebuilt modules need 2.32. ptxas 13.0 reports small register spills
(12-28 bytes) in the hdim-128 kernels; FA3's setup.py prefers ptxas 12.8, which it downloads only for CUDA 12.x.

The sources come from two bare git mirrors (`git archive`, no network), the GPU machine's torch from
`--aot-python`'s environment (it needs `wheel`, `ninja` and `packaging` there), nvcc from CUDA_HOME
(default /usr/local/cuda; CUDA 13.x, so the module links libcudart.so.13, the one torch cu130 loads).

    python benchmarks/fa3_site.py --aot-python /tmp/torch211/bin/python \\
        --fa-git /work/.mirror/Dao-AILab+flash-attention/repo --cutlass-git /work/.mirror/NVIDIA+cutlass/repo

The archive unpacks into a folder on PYTHONPATH:

    flash_attn_interface.py, flash_attn_config.py           (`import flash_attn_interface`)
    flash_attn_3/__init__.py, flash_attn_interface.py, flash_attn_config.py, _C.abi3.so

`flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=None, causal=False, q_descale=..., k_descale=...,
v_descale=...)` takes q, k, v as [batch, seqlen, heads, 128] (last dim contiguous), e4m3 or bf16, and returns the
bf16 output [batch, seqlen, heads, 128]; each descale is a float32 CUDA tensor of shape [batch, kv heads] (strides
are honoured, so a [1, 1] tensor `.expand(batch, heads)` works).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: FA3 features switched off: FLASH_ATTENTION_DISABLE_<name>=TRUE for FA3's hopper/setup.py
DISABLED = ("BACKWARD", "SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA", "FP16", "VARLEN",
            "HDIM64", "HDIM96", "HDIM192", "HDIM256", "HDIMDIFF64", "HDIMDIFF192", "SM80")
#: FA3 features kept: set FALSE explicitly, so that a stray variable in the caller's environment cannot drop them
KEPT = ("FP8", "HDIM128", "CLUSTER")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aot-python", type=Path, required=True,
                   help="the Python of the GPU machine's torch (2.11.0+cu130, 3.12), with wheel, ninja, packaging")
    p.add_argument("--fa-git", type=Path, required=True, help="a (bare) git dir of Dao-AILab/flash-attention")
    p.add_argument("--cutlass-git", type=Path, required=True, help="a (bare) git dir of NVIDIA/cutlass")
    p.add_argument("--out", type=Path, default=ROOT / ".whl" / "fa3-site.tar.gz")
    p.add_argument("--fa-commit", default="HEAD", help="flash-attention commit to build (default HEAD)")
    p.add_argument("--cutlass-commit", default=None,
                   help="CUTLASS commit (default: the one flash-attention's csrc/cutlass submodule pins)")
    p.add_argument("--work", type=Path, default=None,
                   help="keep sources and build here (default: a temporary folder, removed afterwards)")
    p.add_argument("--jobs", type=int, default=2, help="MAX_JOBS for the build (each nvcc takes a few GB)")
    args = p.parse_args(argv)
    if not args.aot_python.is_file():
        p.error(f"--aot-python: expected a Python interpreter, got {args.aot_python} (no such file); "
                "make one with: python3.12 -m venv /tmp/torch211 && /tmp/torch211/bin/pip install torch==2.11.0 "
                "wheel ninja packaging")
    for flag, path in (("--fa-git", args.fa_git), ("--cutlass-git", args.cutlass_git)):
        if not (path / "objects").is_dir() and not (path / ".git").exists():
            p.error(f"{flag}: expected a git directory (bare, with objects/, or a checkout), got {path}; "
                    f"fetch the mirror first")
    if args.jobs < 1:
        p.error(f"--jobs: expected a positive number, got {args.jobs}")
    return args


def git(git_dir: Path, *args: str) -> str:
    """`git --git-dir=git_dir args`, its stdout stripped."""
    done = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git --git-dir={git_dir} {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def export(git_dir: Path, commit: str, paths: list[str], into: Path) -> None:
    """Write `paths` of `commit` into `into` with `git archive`, and check that every file came out: the mirrors
    lack some unrelated blobs (git archive warns about them, yet exits 0), so count files against `git ls-tree`."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", f"--git-dir={git_dir}", "archive", commit, "--", *paths],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    subprocess.run(["tar", "x", "-C", str(into)], stdin=archive.stdout, check=True)
    archive.wait()
    expected = [line for line in git(git_dir, "ls-tree", "-r", "--name-only", commit, "--", *paths).splitlines()]
    missing = [name for name in expected if not (into / name).exists()]
    if missing:
        raise RuntimeError(f"{git_dir} at {commit}: {len(missing)} of {len(expected)} files under {paths} are "
                           f"missing from the mirror (first: {missing[0]}); fetch the repository again")


def cutlass_pin(fa_git: Path, fa_commit: str) -> str:
    """The CUTLASS commit flash-attention's csrc/cutlass submodule pins at `fa_commit`."""
    entry = git(fa_git, "ls-tree", fa_commit, "csrc/cutlass")  # "160000 commit <sha>\tcsrc/cutlass"
    match = re.match(r"160000 commit ([0-9a-f]{40})\s", entry)
    if match is None:
        raise RuntimeError(f"expected csrc/cutlass to be a submodule at flash-attention {fa_commit}, got {entry!r}; "
                           "pass --cutlass-commit")
    return match.group(1)


def lay_out(args: argparse.Namespace, src: Path) -> tuple[str, str]:
    """FA3's hopper/ and README.md (its setup.py reads ../README.md) under `src`, CUTLASS's include/ under
    `src/csrc/cutlass` (where setup.py looks for it); returns the two full commit ids."""
    fa_commit = git(args.fa_git, "rev-parse", f"{args.fa_commit}^{{commit}}")
    cutlass_commit = args.cutlass_commit or cutlass_pin(args.fa_git, fa_commit)
    try:
        cutlass_commit = git(args.cutlass_git, "rev-parse", f"{cutlass_commit}^{{commit}}")
    except RuntimeError as error:
        raise RuntimeError(f"{args.cutlass_git} lacks CUTLASS {cutlass_commit} (for flash-attention {fa_commit}); "
                           "fetch CUTLASS again or pass --cutlass-commit (the nearest 4.x release tag)") from error
    export(args.fa_git, fa_commit, ["hopper", "README.md"], src)
    export(args.cutlass_git, cutlass_commit, ["include"], src / "csrc" / "cutlass")
    if not (src / "hopper" / "setup.py").is_file() or not (src / "hopper" / "flash_attn_3").is_dir():
        raise RuntimeError(f"flash-attention {fa_commit} has no hopper/setup.py or hopper/flash_attn_3/ package: "
                           "this script expects FA3 of 2025 or later; pass a newer --fa-commit")
    return fa_commit, cutlass_commit


def build_env(python: Path, src: Path, jobs: int) -> dict[str, str]:
    """The environment FA3's setup.py builds in: the feature flags above, sm_90a, CUDA_HOME's nvcc, `python`'s
    folder first on the PATH (its ninja), and git unable to climb out of `src` (setup.py runs
    `git submodule update --init`, which must not touch an enclosing repository)."""
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    env = {**os.environ, "CUDA_HOME": cuda_home, "TORCH_CUDA_ARCH_LIST": "9.0a",
           "MAX_JOBS": str(jobs), "NVCC_THREADS": "1", "GIT_CEILING_DIRECTORIES": str(src.parent),
           "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTENTION_OFFLINE_BUILD": "TRUE"}
    env.update({f"FLASH_ATTENTION_DISABLE_{name}": "TRUE" for name in DISABLED})
    env.update({f"FLASH_ATTENTION_DISABLE_{name}": "FALSE" for name in KEPT})
    env["PATH"] = f"{python.parent}{os.pathsep}{cuda_home}/bin{os.pathsep}{env.get('PATH', '')}"
    return env


def check_toolchain(python: Path, env: dict[str, str]) -> None:
    """nvcc 13.x (the module must link the libcudart.so.13 torch cu130 loads) and the build's Python packages."""
    nvcc = Path(env["CUDA_HOME"]) / "bin" / "nvcc"
    if not nvcc.is_file():
        raise RuntimeError(f"expected nvcc at {nvcc}; set CUDA_HOME to a CUDA 13 toolkit")
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    if "release 13." not in version:
        raise RuntimeError(f"expected CUDA 13.x nvcc (torch cu130's libcudart.so.13), got: {version.splitlines()[-2]}")
    probe = ("import torch, wheel, packaging, ninja; from torch.utils.cpp_extension import is_ninja_available; "
             "assert is_ninja_available(); print(torch.__version__)")
    done = subprocess.run([str(python), "-c", probe], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{python} cannot build FA3 ({done.stderr.strip().splitlines()[-1]}); "
                           f"install what it lacks: {python} -m pip install torch==2.11.0 wheel ninja packaging")
    print(f"torch {done.stdout.strip()}, {version.splitlines()[-2]}", flush=True)


def build(python: Path, hopper: Path, env: dict[str, str]) -> Path:
    """`setup.py build_ext --inplace` in `hopper`; its log goes to hopper/build.log. Returns the built module."""
    log = hopper / "build.log"
    start = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run([str(python), "setup.py", "build_ext", "--inplace"], cwd=hopper, env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    minutes, seconds = divmod(int(time.monotonic() - start), 60)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"FA3's build failed after {minutes} min {seconds} s; last lines of {log}:\n"
                           + "\n".join(tail))
    modules = sorted((hopper / "flash_attn_3").glob("_C*.so"))
    if len(modules) != 1:
        raise RuntimeError(f"expected one flash_attn_3/_C*.so in {hopper} after the build, got {modules}")
    print(f"built {modules[0].name} in {minutes} min {seconds} s", flush=True)
    return modules[0]


def pack(hopper: Path, module: Path, site: Path, out: Path) -> None:
    """The interface (top-level `flash_attn_interface`, `flash_attn_config` that setup.py wrote with the build's
    flags, the `flash_attn_3` package) and the module without debug info, as `out`."""
    package = site / "flash_attn_3"
    package.mkdir(parents=True)
    for name in ("flash_attn_interface.py", "flash_attn_config.py"):
        shutil.copyfile(hopper / name, site / name)
    for source in (hopper / "flash_attn_3").glob("*.py"):
        shutil.copyfile(source, package / source.name)
    strip = shutil.which("strip")
    if strip is None:
        raise RuntimeError("expected `strip` (binutils) on the PATH, to drop the module's debug info")
    subprocess.run([strip, "--strip-debug", "-o", str(package / module.name), str(module)], check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for path in sorted(site.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(site)), recursive=False)


def check_import(python: Path, out: Path, work: Path) -> None:
    """Unpack `out` into an empty folder and import it with `python`: loads the module and registers its
    operators, which needs torch's libraries but no GPU."""
    folder = work / "import-check"
    folder.mkdir()
    with tarfile.open(out) as tar:
        tar.extractall(folder, filter="data")
    probe = ("import torch, flash_attn_interface, flash_attn_3; "
             "print('import ok:', flash_attn_interface.__file__, torch.ops.flash_attn_3.fwd.default._schema.name)")
    env = {**os.environ, "PYTHONPATH": str(folder)}
    subprocess.run([str(python), "-c", probe], env=env, cwd=folder, check=True)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out.resolve()
    with tempfile.TemporaryDirectory(prefix="fa3-site-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        if work.exists() and any(work.iterdir()):
            raise RuntimeError(f"--work: expected an empty or new folder, got {work} (not empty); remove it")
        src = work / "src"
        fa_commit, cutlass_commit = lay_out(args, src)
        print(f"flash-attention {fa_commit}, CUTLASS {cutlass_commit}", flush=True)
        env = build_env(args.aot_python, src, args.jobs)
        check_toolchain(args.aot_python, env)
        module = build(args.aot_python, src / "hopper", env)
        pack(src / "hopper", module, work / "site", out)
        check_import(args.aot_python, out, work)
    print(f"{out}: {out.stat().st_size / 2**20:.2f} MiB")
    return out


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        sys.exit(f"fa3_site: {error}")
