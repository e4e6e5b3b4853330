"""What torchao's dynamic per-row fp8 activation quantization costs at Flux-dev 1024²'s shapes.

The step profile (`benchmarks/step_profile.py`; BENCHMARKS.md, "Where the uncached fp8 step's time goes") puts a
large share of the fp8 + graphs step in activation quantization: inductor makes each row's amax a *looped*
reduction (its persistent-reduction limit is 1024 elements per row) and then recomputes the producer (cat + GELU of
the single blocks' proj_out input) in a second pointwise pass that divides and casts. This script times one quantized Linear per pattern, compiled as hookkit compiles a quantized region,
with inductor options that allow one-pass (persistent) row reductions, beside a one-pass hand-written Triton
kernel (the bandwidth floor of "read the row once, write fp8 once"):

  proj_out   x = cat(attn [M, 3072], gelu_tanh(mlp [M, 12288])) -> Linear(15360 -> 3072)   (38 single blocks)
  ff_down    x = gelu_tanh(h [M, 12288]) -> Linear(12288 -> 3072)                          (19 double blocks x 2)
  qkv        x = layer_norm(h [M, 3072]) * (1 + scale) + shift -> 3 x Linear(3072 -> 3072) (every block)

Options (`--options`, comma-separated): base (hookkit's QUANTIZED_INDUCTOR_OPTIONS), mk1 (+ triton.multi_kernel=1:
persistent reductions up to 16x wider, the faster kernel picked by benchmarking), mk2 (multi_kernel=2: persistent
forced), hookkit / hookkit-fast (Compile(fuse_fp8_rows="exact" / "fast")'s post-grad pass: its one-pass kernel
where X is a GELU or a concatenation with one). Per pattern and option: median call time (CUDA events, 50 calls after 10 warm-up), and the profiler's
device time of the non-GEMM kernels (the quantization and its fused producer). Writes $OUT/rowwise_quant.json.

    python benchmarks/rowwise_quant.py            # H200, ~1.5 min
    python benchmarks/rowwise_quant.py --options '' --only-arithmetic   # what tanh and the division cost, ~20 s

The arithmetic rows time hookkit's kernel layout with each tanh (libdevice, exp) and division (IEEE `div_rn`, the
reciprocal with one FMA correction, approximate): Markstein's correction keeps the quotient correctly rounded, so
its codes must equal eager torchao's as `div_rn`'s do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import time_calls  # noqa: E402
from hookkit.techniques.compile.hooks import QUANTIZED_INDUCTOR_OPTIONS

OPTIONS = {"base": {}, "mk1": {"triton.multi_kernel": 1}, "mk2": {"triton.multi_kernel": 2}, "hookkit": {},
           "hookkit-fast": {}}
GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|_scaled_mm|scaled_mm", re.I)


class ProjOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(15360, 3072)

    def forward(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))


class FFDown(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12288, 3072)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(h, approximate="tanh"))


class QKV(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(3072, 3072) for _ in range(3))

    def forward(self, h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(h, (3072,), eps=1e-6) * (1 + scale) + shift
        return self.q(x) + self.k(x) + self.v(x)


def patterns(m: int) -> dict[str, tuple[type[torch.nn.Module], tuple[torch.Tensor, ...]]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return {"proj_out": (ProjOut, (r(m, 3072), r(m, 12288))), "ff_down": (FFDown, (r(m, 12288),)),
            "qkv": (QKV, (r(m, 3072), r(1, 3072) * 0.1, r(1, 3072) * 0.1))}


def kernel_split(fn: Any, calls: int = 10) -> dict[str, Any]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1e3 / calls) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    gemm = sum(ms for k, ms in kernels if GEMM.search(k))
    other = sum(ms for k, ms in kernels if not GEMM.search(k))
    return dict(gemm_ms=gemm, non_gemm_ms=other,
                kernels=[dict(name=k[:140], ms=ms) for k, ms in sorted(kernels, key=lambda x: -x[1])[:8]])


def compiled_row(name: str, option: str, m: int) -> dict[str, Any]:
    from torchao.quantization import quantize_

    from hookkit.techniques.quantize.torchao import make_config

    cls, inputs = patterns(m)[name]
    module = cls().to("cuda", torch.bfloat16).eval()
    quantize_(module, make_config("fp8_row"))  # hookkit's fp8 per-row config (its amax bound included)
    torch._dynamo.reset()
    extra: dict[str, Any] = dict(OPTIONS[option])
    rows = None
    if option.startswith("hookkit"):  # hookkit's one-pass kernel through its post-grad pass (Compile(fuse_fp8_rows))
        from hookkit.techniques.compile.fp8_rows import FusedFp8Rows

        rows = extra["post_grad_custom_post_pass"] = FusedFp8Rows(fast=option == "hookkit-fast")
        extra["fx_graph_cache"] = False  # a cached graph would not show the rewrite count
    fn = torch.compile(module, fullgraph=True, options={**QUANTIZED_INDUCTOR_OPTIONS, **extra})
    with torch.no_grad():
        times = time_calls(lambda: fn(*inputs), repeats=50, warmup=10)
        split = kernel_split(lambda: fn(*inputs))
        out = fn(*inputs).float()
        ref = module(*inputs).float()  # eager torchao: the same quantization, unfused
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    return dict(pattern=name, variant=option, ms=statistics.median(times), ms_min=min(times), ms_max=max(times),
                rel_err_vs_eager_torchao=err, bitwise_eager=bool(torch.equal(out, ref)),
                rewritten=rows.rewritten if rows is not None else None, **split)


def triton_one_pass() -> Any:
    """Row amax, scale and e4m3 cast in one read of the row (BLOCK = the whole row, as a persistent reduction)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, y_ptr, s_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
        scale = amax / 448.0
        y = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(y_ptr + row * n_cols + cols, y.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        y = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
        block = triton.next_power_of_2(k)
        kernel[(m,)](x, y, s, k, BLOCK=block, num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
        return y, s

    return quantize


def triton_fused_proj_out() -> Any:
    """cat(attn, gelu_tanh(mlp)) + row amax + scale + e4m3 cast in one read of the inputs (what inductor does in two)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gelu(x):
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))

    @triton.jit
    def kernel(a_ptr, m_ptr, y_ptr, s_ptr, A: tl.constexpr, C: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, C)
        a = tl.load(a_ptr + row * A + cols, mask=cols < A, other=0.0).to(tl.float32)
        m0 = gelu(tl.load(m_ptr + row * 4 * A + cols).to(tl.float32))
        m1 = gelu(tl.load(m_ptr + row * 4 * A + C + cols).to(tl.float32))
        m2 = gelu(tl.load(m_ptr + row * 4 * A + 2 * C + cols).to(tl.float32))
        amax = tl.max(tl.maximum(tl.maximum(tl.abs(a), tl.abs(m0)), tl.maximum(tl.abs(m1), tl.abs(m2))), axis=0)
        scale = tl.maximum(amax, 1e-12) / 448.0
        out = y_ptr + row * 5 * A
        tl.store(out + cols, tl.clamp(a / scale, -448.0, 448.0).to(tl.float8e4nv), mask=cols < A)
        tl.store(out + A + cols, tl.clamp(m0 / scale, -448.0, 448.0).to(tl.float8e4nv))
        tl.store(out + A + C + cols, tl.clamp(m1 / scale, -448.0, 448.0).to(tl.float8e4nv))
        tl.store(out + A + 2 * C + cols, tl.clamp(m2 / scale, -448.0, 448.0).to(tl.float8e4nv))
        tl.store(s_ptr + row, scale)

    def quantize(attn: torch.Tensor, mlp: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, a = attn.shape  # a = 3072, mlp is [m, 4a]: chunks of 4096 (the first masked to 3072)
        y = torch.empty(m, 5 * a, device=attn.device, dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, device=attn.device, dtype=torch.float32)
        kernel[(m,)](attn, mlp, y, s, A=a, C=4096, num_warps=num_warps)
        return y, s

    return quantize


def arithmetic_rows(m: int) -> list[dict[str, Any]]:
    """What each part of the exact arithmetic costs: hookkit's kernel layout for the proj_out input (attention in one
    chunk of 4,096, GELU(MLP) in three, bf16 in registers) with tanh from libdevice or exp, and the division IEEE
    (`div_rn`), by the reciprocal with one FMA correction (Markstein: correctly rounded, so still exact) or approximate.
    Each row says how many fp8 codes differ from eager torchao's arithmetic."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from hookkit.techniques.compile import fp8_rows

    @triton.jit
    def chunk(ptr, row, width, C: tl.constexpr, GELU: tl.constexpr, TANH: tl.constexpr):
        cols = C * 4096 + tl.arange(0, 4096)
        x = tl.load(ptr + row * width + cols, mask=cols < width, other=0.0)
        if GELU:
            f = x.to(tl.float32)
            u = 0.7978845608028654 * (f + 0.044715 * (f * f * f))
            if TANH == 0:
                t = libdevice.tanh(u)
            else:
                t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
            x = (0.5 * f * (1.0 + t)).to(tl.bfloat16)
        return x

    @triton.jit
    def put(q_ptr, offset, x, scale, inverse, width, C: tl.constexpr, DIV: tl.constexpr):
        cols = C * 4096 + tl.arange(0, 4096)
        f = x.to(tl.float32)
        if DIV == 0:
            q = tl.math.div_rn(f, tl.zeros_like(f) + scale)
        elif DIV == 1:  # Markstein: q0 = f * RN(1/s), r = f - q0 * s (exact, FMA), q = RN(q0 + r * RN(1/s))
            q0 = f * inverse
            q = tl.fma(tl.fma(-q0, tl.zeros_like(f) + scale, f), tl.zeros_like(f) + inverse, q0)
            q = tl.where(q0 == 0.0, q0, q)  # -0 stays -0, as in hookkit's kernel
        else:
            q = f / scale
        tl.store(q_ptr + offset + cols, tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv), mask=cols < width)

    @triton.jit
    def kernel(a_ptr, b_ptr, q_ptr, s_ptr, TANH: tl.constexpr, DIV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        a0 = chunk(a_ptr, row, 3072, 0, False, TANH)
        b0 = chunk(b_ptr, row, 12288, 0, True, TANH)
        b1 = chunk(b_ptr, row, 12288, 1, True, TANH)
        b2 = chunk(b_ptr, row, 12288, 2, True, TANH)
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(a0.to(tl.float32)), axis=0), tl.max(tl.abs(b0.to(tl.float32)), axis=0)),
                          tl.maximum(tl.max(tl.abs(b1.to(tl.float32)), axis=0), tl.max(tl.abs(b2.to(tl.float32)), axis=0)))
        scale = tl.math.div_rn(amax, amax * 0.0 + 448.0).to(tl.bfloat16).to(tl.float32)
        inverse = tl.math.div_rn(scale * 0.0 + 1.0, scale)
        out = row * 15360
        put(q_ptr, out, a0, scale, inverse, 3072, 0, DIV)
        put(q_ptr, out + 3072, b0, scale, inverse, 12288, 0, DIV)
        put(q_ptr, out + 3072, b1, scale, inverse, 12288, 1, DIV)
        put(q_ptr, out + 3072, b2, scale, inverse, 12288, 2, DIV)
        tl.store(s_ptr + row, scale)

    g = torch.Generator(device="cuda").manual_seed(0)
    attn = torch.randn(m, 3072, generator=g, device="cuda", dtype=torch.bfloat16)
    mlp = torch.randn(m, 12288, generator=g, device="cuda", dtype=torch.bfloat16)
    ref_q, ref_s = fp8_rows._reference([attn, mlp], [False, True])
    rows = []
    for tanh, div in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)):
        q = torch.empty(m, 15360, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(m, 1, device="cuda", dtype=torch.float32)
        run = lambda: kernel[(m,)](attn, mlp, q, s, TANH=tanh, DIV=div, num_warps=8)  # noqa: E731
        run()
        mismatch = (q.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean().item()
        split = kernel_split(run)
        rows.append(dict(pattern="proj_out", variant=f"arithmetic: tanh={'libdevice' if tanh == 0 else 'exp'}, "
                         f"division={('div_rn', 'markstein', 'approximate')[div]}", kernel_us=1e3 * split["non_gemm_ms"],
                         fp8_mismatch_fraction=mismatch, scales_equal=bool(torch.equal(s, ref_s))))
    return rows


def bandwidth_rows() -> list[dict[str, Any]]:
    """What this GPU's memory moves: a 2 GiB bf16 copy (read + write), the yardstick for the kernels above."""
    x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    times = time_calls(lambda: y.copy_(x), repeats=20, warmup=3)
    return [dict(pattern="copy 2 GiB", variant="torch copy_", ms=statistics.median(times),
                 tb_per_s=2 * x.numel() * 2 / statistics.median(times) / 1e9)]


def fused_rows(m: int) -> list[dict[str, Any]]:
    quantize = triton_fused_proj_out()
    g = torch.Generator(device="cuda").manual_seed(0)
    attn = torch.randn(m, 3072, generator=g, device="cuda", dtype=torch.bfloat16)
    mlp = torch.randn(m, 12288, generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1).float()
    ref_s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    rows = []
    for warps in (4, 8, 16, 32):
        y, s = quantize(attn, mlp, warps)
        scale_err = ((s - ref_s).abs() / ref_s).max().item()
        mismatch = (y.float() != (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()).float().mean().item()
        times = time_calls(lambda: quantize(attn, mlp, warps), repeats=50, warmup=10)
        moved = m * 15360 * 2 + m * 15360  # bf16 inputs read once + fp8 written once
        rows.append(dict(pattern="proj_out", variant=f"triton fused one-pass, num_warps={warps}",
                         ms=statistics.median(times), ms_min=min(times), ms_max=max(times),
                         scale_rel_err=scale_err, fp8_mismatch_fraction=mismatch,
                         tb_per_s=moved / statistics.median(times) / 1e9))
    return rows


def triton_rows(m: int) -> list[dict[str, Any]]:
    """Quantization alone, on an already materialized bf16 input (the producer not fused), per pattern width."""
    quantize = triton_one_pass()
    rows = []
    for name, k in (("proj_out", 15360), ("ff_down", 12288), ("qkv", 3072)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y, s = quantize(x)
        ref_s = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        scale_err = ((s - ref_s).abs() / ref_s).max().item()  # Triton's fp32 `/` is approximate: codes may differ by one
        mismatch = (y.float() != (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()).float().mean().item()
        times = time_calls(lambda: quantize(x), repeats=50, warmup=10)
        moved = x.numel() * 3  # bf16 read + fp8 write, bytes
        rows.append(dict(pattern=name, variant="triton-one-pass (quantization only)", ms=statistics.median(times),
                         ms_min=min(times), ms_max=max(times), scale_rel_err=scale_err, fp8_mismatch_fraction=mismatch,
                         tb_per_s=moved / statistics.median(times) / 1e9))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4608, help="rows M (Flux-dev 1024²: 4096 image + 512 text)")
    p.add_argument("--options", default="base,mk1,mk2,hookkit,hookkit-fast", help="'' (none) to run only the Triton and copy rows")
    p.add_argument("--no-extras", action="store_true", help="skip the hand-written Triton and copy rows")
    p.add_argument("--only-arithmetic", action="store_true",
                   help="of the hand-written rows, only the exact-arithmetic cost split (with --options '')")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("rowwise_quant.py needs a CUDA GPU with fp8 (sm89+).", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(n, o) for n in ("proj_out", "ff_down", "qkv") for o in args.options.split(",") if o]
    for name, option in jobs:
        try:
            rows.append(compiled_row(name, option, args.tokens))
        except Exception as exc:  # noqa: BLE001 (a failing option is a result)
            traceback.print_exc()
            rows.append(dict(pattern=name, variant=option, status="failed", note=f"{type(exc).__name__}: {exc}"[:300]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
        (out / "rowwise_quant.json").write_text(json.dumps(dict(tokens=args.tokens, rows=rows), indent=1))
    extras = (triton_rows, fused_rows, arithmetic_rows, lambda m: bandwidth_rows())
    if args.only_arithmetic:
        extras = (arithmetic_rows,)
    for extra in () if args.no_extras else extras:
        try:
            new = extra(args.tokens)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            new = [dict(variant=getattr(extra, "__name__", "bandwidth"), status="failed",
                        note=f"{type(exc).__name__}: {exc}"[:300])]
        rows += new
        for r in new:
            print(json.dumps(r), flush=True)
    (out / "rowwise_quant.json").write_text(json.dumps(dict(tokens=args.tokens, torch=torch.__version__, rows=rows),
                                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
