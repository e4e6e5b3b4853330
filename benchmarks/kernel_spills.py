"""Registers and spills of hookkit's attention kernels as the installed Triton builds them for Hopper, on the CPU.

Why: a kernel whose key loop spills registers to local memory runs far slower on the GPU while its arithmetic (all the
CPU interpreter checks) stays the same. A one-line change to `hookkit_fp8`'s epilogue (a `where` on the running sum)
made Triton 3.6's build spill in every key block of the unmasked kernel, much slower on an H100 (BENCHMARKS.md);
nothing on the CPU showed it until the kernel was built the way its launch builds it. This script
does that without a GPU: Triton's own launch binder specializes the arguments of the real call (which integers divide
by 16, which pointers are aligned), `triton.compile` builds for sm_90a, `ptxas -v` reports registers and spill bytes
and `cuobjdump -sass` the machine code, in which each loop (a backward branch) is searched for spill stores (`STL`)
and loads (`LDL`).

    python benchmarks/kernel_spills.py                      # Wan 2.1 14B's call: 40 heads x 128, 32,760 tokens
                                                            # (masked as HunyuanVideo 1.5's, also in 4 warps on
                                                            # smaller tiles; the mask's tiles, int8)
    python benchmarks/kernel_spills.py --tokens 8192 --out out/kernel_spills.json

Triton's builds differ by version (the GPU machine's 3.6 spilled where 3.9 does not), so a result holds for the Triton
that made it; the JSON records the version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Loop:
    """One loop of a kernel's machine code: the instructions from a backward branch's target to the branch.

    Args:
        start: address of the loop's first instruction.
        end: address of its backward branch.
        instructions: how many instructions it holds.
        spill_stores: its `STL` instructions (registers spilled to local memory).
        spill_loads: its `LDL` instructions.
    """

    start: int
    end: int
    instructions: int
    spill_stores: int
    spill_loads: int


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def loops(sass: str) -> list[Loop]:
    """Every loop of `sass` (`cuobjdump -sass` text of one kernel), in address order: a branch to an earlier address
    closes the loop that starts there. Nested loops are each listed (the outer one counts the inner one's
    instructions too)."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    found = []
    for i, (address, text) in enumerate(instructions):
        branch = _BRANCH.search(text)
        if branch is None:
            continue
        target = int(branch.group(1), 16)
        if target < address and target in index:
            body = [t for _, t in instructions[index[target]:i + 1]]
            found.append(Loop(target, address, len(body), sum(_opcode(t) == "STL" for t in body),
                              sum(_opcode(t) == "LDL" for t in body)))
    return sorted(found, key=lambda loop: loop.start)


def _opcode(text: str) -> str:
    """`STL.64 [R1+0x10], R4` -> "STL"; a predicate (`@P0 `) is skipped."""
    words = text.split()
    word = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
    return word.split(".")[0]


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself builds `arch` with (Triton 3.9 takes its newer one, named ptxas-blackwell, for Hopper
    too: the PTX it writes is too new for the other)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.is_file():
        raise FileNotFoundError(f"kernel_spills: Triton {triton.__version__} ships no cuobjdump at {path}")
    return str(path)


def build(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], arch: int = 90) -> Any:
    """`kernel[grid](*args, **kwargs)` built as its launch would build it, for compute capability `arch` (no GPU
    needed): Triton's launch binder specializes `args` (tensors may be CPU tensors of the launch's dtypes: only their
    dtype and alignment count), then `triton.compile`. Returns Triton's compiled kernel (`.asm`: ttir ... ptx, cubin).
    Uses the binder Triton builds for every JIT function (`create_function_from_signature`, `_pack_args`): internal
    API, checked on Triton 3.6 and 3.9."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def report(compiled: Any, arch: int = 90) -> dict[str, Any]:
    """Registers and spill bytes (`ptxas -v` on the kernel's PTX) and the loops of its machine code (`loops`)."""
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        Path(cubin).write_bytes(compiled.asm["cubin"])
        ptxas = subprocess.run([_ptxas(arch), "-v", f"-arch=sm_{arch}a", ptx, "-o",
                                os.path.join(folder, "v.cubin")], capture_output=True, text=True, check=True)
        sass = subprocess.run([_cuobjdump(), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    text = ptxas.stdout + ptxas.stderr
    registers = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    spill_loads = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_store_bytes": int(stores.group(1)) if stores else None,
            "spill_load_bytes": int(spill_loads.group(1)) if spill_loads else None,
            "loops": [asdict(loop) for loop in loops(sass)]}


def _mask_args(masked: bool, dummy: torch.Tensor) -> list[Any]:
    """The ten mask arguments of an attention kernel's launch as `mask_tiles.kernel_args` passes them: for a
    `[1, 1, 1, S]` key mask (bytes, block lists, counts, strides), or without one (`dummy` and zeros)."""
    if masked:
        return [torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.int32),
                torch.empty(64, dtype=torch.int32), 0, 0, 0, 1, 0, 0, 0]
    return [dummy] * 3 + [0] * 7


def fp8_attention_launch(tokens: int = 32760, heads: int = 40, dim: int = 128, masked: bool = False,
                         block_m: int | None = None, block_n: int | None = None,
                         warps: int | None = None, key_counts: bool = False) -> tuple[Any, tuple[Any, ...],
                                                                                     dict[str, Any]]:
    """The `_fp8_attention_kernel` launch of `fp8_triton.run_quantized` for a self-attention call of `tokens` tokens
    and `heads` heads of `dim` as Wan's processor makes it (`[B, S, H, D]` seen as `[B, H, S, D]`: the output's
    strides), with `Attention`'s defaults; `masked`: with a boolean padding mask, as HunyuanVideo 1.5's calls;
    `key_counts`: unmasked, each batch element's key loop ending at its count of valid keys (the validity row's
    launch); `block_m`, `block_n`, `warps`: other than the launch's (`fp8_triton.launch`)."""
    from hookkit.techniques.attention import fp8_triton

    block_m, block_n = fp8_triton.launch_tiles(masked, block_m, block_n)
    blocks = -(-tokens // block_m)
    key_blocks = -(-tokens // block_n)

    def tensor(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(64, dtype=dtype)

    scales = tensor(torch.float32)
    inputs = (tensor(torch.int8), tensor(torch.int8), tensor(torch.float8_e4m3fn), scales, tensor(torch.float32),
              tensor(torch.float32), tensor(torch.float32))
    out_strides = (tokens * heads * dim, dim, heads * dim)
    args = (*inputs, tensor(torch.bfloat16), heads, tokens, tokens, blocks, key_blocks, *out_strides,
            *_mask_args(masked, scales), tensor(torch.int32) if key_counts else scales)
    kwargs = dict(D=dim, BLOCK_M=block_m, BLOCK_N=block_n, QK_INT8=True, EXP_F16=False, LOOP=0, TMA=False,
                  INTERPRET=False, MASKED=masked, KEY_COUNTS=key_counts,
                  num_warps=fp8_triton.launch(masked)[2] if warps is None else warps, num_stages=3)
    return fp8_triton._fp8_attention_kernel, args, kwargs


def int8_attention_launch(tokens: int = 32760, heads: int = 40, dim: int = 128, masked: bool = False,
                          warps: int | None = None,
                          key_counts: bool = False) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The `_int8_attention_kernel` launch of `int8_triton.attention` (`hookkit_int8`, `Attention`'s default
    `low_precision`) for the call `fp8_attention_launch` describes: V in Wan's layout, 128 x 64 tiles, Triton's
    default warps unless `warps`; `key_counts` as `fp8_attention_launch`'s."""
    from hookkit.techniques.attention import int8_triton

    block_m, block_n = 128, 64
    scales = torch.empty(64, dtype=torch.float32)
    v_strides = (tokens * heads * dim, dim, heads * dim)  # Wan's `[B, S, H, D]` seen as `[B, H, S, D]`
    out_strides = (heads * tokens * dim, tokens * dim, dim)  # the kernel's own contiguous output
    args = (torch.empty(64, dtype=torch.int8), torch.empty(64, dtype=torch.int8), torch.empty(64, dtype=torch.bfloat16),
            scales, torch.empty(64, dtype=torch.float32), torch.empty(64, dtype=torch.bfloat16), heads, tokens, tokens,
            -(-tokens // block_m), -(-tokens // block_n), *v_strides, *out_strides, *_mask_args(masked, scales),
            torch.empty(64, dtype=torch.int32) if key_counts else scales)
    kwargs: dict[str, Any] = dict(D=dim, BLOCK_M=block_m, BLOCK_N=block_n, MASKED=masked, KEY_COUNTS=key_counts)
    if warps is not None:
        kwargs["num_warps"] = warps
    return int8_triton._int8_attention_kernel, args, kwargs


def mask_tiles_launch(tokens: int = 34745) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The `_mask_tiles_kernel` launch of `mask_tiles.mask_tiles` for a `[1, 1, tokens, tokens]` boolean mask (as
    HunyuanVideo 1.5's processor builds it: every query row its own, rows `tokens` bytes apart), on the tiles of the
    masked fp8 kernel's launch (`fp8_triton.launch`)."""
    from hookkit.techniques.attention import fp8_triton, mask_tiles

    block_m, block_n, _ = fp8_triton.launch(True)
    args = (torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.int8), tokens, tokens,
            -(-tokens // block_m), -(-tokens // block_n), 1, 0, 0, tokens, 1)
    return mask_tiles._mask_tiles_kernel, args, dict(BLOCK_M=block_m, BLOCK_N=block_n,
                                                     ROWS=min(mask_tiles.TILE_ROWS_A_STEP, block_m))


#: (BLOCK_M, BLOCK_N, warps) of the masked fp8 kernel that the report builds (and benchmarks/attention_padding_mask.py
#: times) beside the launch's own (`fp8_triton.launch`: 64 x 128 in 4 warps): the launch before it (128 x 128 in 8
#: warps), 128 x 128 in 4 (its every-pair loop spills) and 128 x 64 in 4
MASKED_ALTERNATIVES = ((128, 128, 8), (128, 128, 4), (128, 64, 4))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32760, help="self-attention length (default: Wan 2.1 14B's)")
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the report")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import triton

    args = parse_args(argv)
    result: dict[str, Any] = {"triton": triton.__version__, "arch": args.arch, "tokens": args.tokens,
                              "heads": args.heads, "dim": args.dim, "kernels": {}}
    launches = {"hookkit_fp8": fp8_attention_launch(args.tokens, args.heads, args.dim, False),
                "hookkit_fp8 key counts": fp8_attention_launch(args.tokens, args.heads, args.dim, key_counts=True),
                "hookkit_fp8 masked": fp8_attention_launch(args.tokens, args.heads, args.dim, True),
                # the masked kernel's other tilings (benchmarks/attention_padding_mask.py times them)
                **{f"hookkit_fp8 masked {w} warps {bm}x{bn}": fp8_attention_launch(args.tokens, args.heads, args.dim,
                                                                                   True, bm, bn, w)
                   for bm, bn, w in MASKED_ALTERNATIVES},
                "mask tiles": mask_tiles_launch(args.tokens),
                "hookkit_int8": int8_attention_launch(args.tokens, args.heads, args.dim, False),
                "hookkit_int8 masked": int8_attention_launch(args.tokens, args.heads, args.dim, True),
                "hookkit_int8 key counts": int8_attention_launch(args.tokens, args.heads, args.dim, key_counts=True)}
    for name, (kernel, kernel_args, kwargs) in launches.items():
        row = report(build(kernel, kernel_args, kwargs, args.arch), args.arch)
        result["kernels"][name] = row
        in_loops = sum(loop["spill_stores"] for loop in row["loops"])
        print(f"{name:<20} {row['registers']} registers, spills {row['spill_store_bytes']} B stored "
              f"{row['spill_load_bytes']} B loaded; {len(row['loops'])} loops, {in_loops} spill stores in them",
              flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
