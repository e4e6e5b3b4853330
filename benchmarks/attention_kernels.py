"""Attention kernels at a video shape: cuDNN SDPA, flash SDPA, sageattention (if importable), hookkit's int8 and fp8
kernels (`hookkit_fp8` as `Attention` runs it, V smoothed from 2,048 keys; `hookkit_fp8_unsmoothed_v` with V as it
comes; `hookkit_fp8_kernel` the kernel alone on inputs quantized once), FlashInfer's FA3 kernels (if importable:
`flashinfer_bf16`; `flashinfer_fp8` with hookkit's quantization as it runs eagerly (Triton kernels; V smoothed, its mean
added back), `flashinfer_fp8_unsmoothed_v` the same with V as it comes, `flashinfer_fp8_compiled` with its torch ops
compiled by inductor, as regional `Compile` runs them around the kernel in a block, `flashinfer_fp8_kernel` alone on
inputs quantized once, V as it comes), and TensorRT-LLM's FMHA v2 kernels where `benchmarks/fmha_v2_site.py` prebuilt
them (`fmha_v2_fp8_kernel`: the e4m3 kernel alone on its packed `[tokens, 3, heads, dim]` input, quantized once per
tensor; `fmha_v2_bf16`: its bf16 kernel on `[tokens, heads, dim]` Q, K, V, laid out once, as diffusers has them before
SDPA), and FlashAttention-3's own Hopper kernels where `benchmarks/fa3_site.py` prebuilt them (`fa3_fp8_kernel`: its
e4m3 kernel alone on inputs quantized once per head, as FlashInfer's port of it is fed; `fa3_bf16`: its bf16 kernel).

Default shape: Wan 2.1 at 480x832x81 frames, 32,760 tokens, batch 1, bf16, 40 heads x 128 (14B) and 12 heads x 128
(1.3B). Each kernel is timed as CUDA-graph replays (CUDA events around each replay; a kernel that cannot be captured is
timed as plain calls, and says so) after warm-up: median and min-max of `--repeats` runs, effective TFLOP/s
(4 * N^2 * heads * dim / time), and its error against an fp32 reference (max abs, mean relative). Each kernel runs in
its own try/except; an error is recorded in its row, never stops the others.

    python benchmarks/attention_kernels.py --out results/attention_kernels.json
    python benchmarks/attention_kernels.py --tokens 8192 --heads 24 --dim 128

`--device cpu` (with TRITON_INTERPRET=1) runs a tiny shape through the same code, timed on the host: for tests only.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fmha_v2_site import MODULE as FMHA_V2_MODULE  # noqa: E402 - under a folder of sys.path
from benchmarks.timing import EVENTS_PLAIN, summary, time_calls, time_graph_replays  # noqa: E402

KERNELS = ("sdpa_cudnn", "sdpa_flash", "sageattention", "hookkit_int8", "hookkit_fp8", "hookkit_fp8_unsmoothed_v",
           "hookkit_fp8_kernel", "flashinfer_bf16",
           "flashinfer_fp8", "flashinfer_fp8_unsmoothed_v", "flashinfer_fp8_compiled", "flashinfer_fp8_kernel",
           "fmha_v2_fp8_kernel", "fmha_v2_bf16", "fa3_fp8_kernel", "fa3_bf16")
#: FMHA v2's scratch memory (FlashInfer's callers pass 128 MiB)
FMHA_V2_WORKSPACE = 128 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32760, help="sequence length N (default: Wan 2.1 480x832x81)")
    p.add_argument("--heads", type=int, nargs="+", default=[40, 12], help="head counts, one shape each (default 40 12)")
    p.add_argument("--dim", type=int, default=128, help="head size (default 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20, help="timed runs per kernel (default 20, at least 10 on a GPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--no-graphs", action="store_true", help="time plain calls with CUDA events, not graph replays")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--flashinfer-aot", type=Path, default=None,
                   help="load FlashInfer's prebuilt modules from this folder (<module>/<module>.so) instead of its "
                        "package's: a build with other tiles (benchmarks/flashinfer_fp8_tiles.py)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.dim < 1 or args.batch < 1 or min(args.heads) < 1:
        p.error("--tokens, --heads, --dim and --batch must be positive")
    if args.device == "cuda" and args.repeats < 10:
        p.error("--repeats: at least 10 on a GPU (median and spread of fewer mean little)")
    return args


def prepared_once(prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
                  run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
                  ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`fn(q, k, v)` that times a kernel alone: `prepare(q, k, v)` (quantization, layout) runs once per input
    tensors (the timing loop passes the same ones every call), `run(q, k, v, prepared)` at every call."""
    memo: dict[tuple[int, ...], Any] = {}

    def alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key = (id(q), id(k), id(v))
        if key not in memo:
            memo.clear()
            memo[key] = prepare(q, k, v)
        return run(q, k, v, memo[key])
    return alone


def kernel_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`fn(q, k, v)` for `[B, H, N, D]` tensors; raises if the kernel is unavailable."""
    if name in ("sdpa_cudnn", "sdpa_flash"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if name == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)
        return sdpa
    if name == "sageattention":
        from hookkit.techniques.attention.hooks import _sage

        return lambda q, k, v: _sage({"query": q, "key": k, "value": v, "is_causal": False, "scale": None})
    if name.startswith("flashinfer"):
        import flashinfer  # noqa: F401 - the row's error where it is not installed, before any compilation

        from hookkit.techniques.attention import flashinfer_fa3

        if name in ("flashinfer_bf16", "flashinfer_fp8"):
            return lambda q, k, v: flashinfer_fa3.attention(q, k, v, fp8=name == "flashinfer_fp8")
        if name == "flashinfer_fp8_unsmoothed_v":
            return lambda q, k, v: flashinfer_fa3.attention(q, k, v, smooth_value=False)
        if name == "flashinfer_fp8_compiled":
            def quantize_smoothed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
                mean = flashinfer_fa3.value_mean(v)
                return (*flashinfer_fa3.quantize(q, k, v, mean), mean)

            quantize = torch.compile(quantize_smoothed, fullgraph=True)
            add_mean = torch.compile(lambda out, mean: (out.float() + mean).to(out.dtype), fullgraph=True)

            def compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                *codes, mean = quantize(q, k, v)
                return add_mean(flashinfer_fa3.run_fp8(*codes, flashinfer_fa3.softmax_scale(q, None), False, q.dtype),
                                mean)
            return compiled
        return prepared_once(flashinfer_fa3.quantize, lambda q, k, v, codes: flashinfer_fa3.run_fp8(
            *codes, flashinfer_fa3.softmax_scale(q, None), False, q.dtype))
    if name.startswith("fmha_v2"):
        return fmha_v2_fn(name.removeprefix("fmha_v2_"))
    if name.startswith("fa3"):
        return fa3_fn(fp8=name == "fa3_fp8_kernel")
    from hookkit.techniques.attention import fp8_triton, int8_triton

    tiles = {} if torch.cuda.is_available() else {"block_m": 32, "block_n": 32}  # the interpreter: small tiles, quick
    if name == "hookkit_fp8_unsmoothed_v":
        return lambda q, k, v: fp8_triton.attention(q, k, v, smooth_value=False, **tiles)
    if name == "hookkit_fp8_kernel":
        return prepared_once(lambda q, k, v: fp8_triton.quantize_inputs(q, k, v, **tiles),
                             lambda q, k, v, inputs: fp8_triton.run_quantized(q, k.shape[2], inputs, **tiles))
    module = fp8_triton if name == "hookkit_fp8" else int8_triton
    return lambda q, k, v: module.attention(q, k, v, **tiles)


def _packed(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Three scaled `[B, H, N, D]` float tensors as FMHA v2's packed e4m3 input, `[B * N, 3, H, D]`."""
    b, h, n, d = parts[0].shape
    packed = torch.empty(b, n, 3, h, d, dtype=torch.float8_e4m3fn, device=parts[0].device)
    for i, t in enumerate(parts):
        packed[:, :, i] = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).transpose(1, 2)
    return packed.flatten(0, 1)


def packed_e4m3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """`[B, H, N, D]` Q, K (smoothed: its mean over the tokens subtracted) and V as FMHA v2's packed e4m3 input,
    `[B * N, 3, H, D]`, each scaled by its own amax / 448; and the three scales."""
    k = k.float() - k.float().mean(dim=2, keepdim=True)
    scales = [float(t.abs().amax().float().clamp(min=2.0 ** -100)) / 448.0 for t in (q, k, v)]
    return _packed(tuple(t.float() / scale for t, scale in zip((q, k, v), scales, strict=True))), scales


def fmha_v2_fn(kind: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """TensorRT-LLM's FMHA v2 on `[B, H, N, D]` bf16 inputs (non-causal: its "padding" mask with every sequence
    full), bf16 out as the `[B, H, N, D]` view of its `[B * N, H, D]` output. `kind`: "fp8_kernel", its e4m3 kernel
    alone on inputs quantized once per tensor (`packed_e4m3`); "bf16", its bf16 kernel on inputs laid out as
    `[B * N, H, D]` once. Raises where the module or tvm_ffi is missing, or off a CUDA device."""
    import tvm_ffi

    path = next((Path(p) / FMHA_V2_MODULE for p in sys.path if (Path(p) / FMHA_V2_MODULE).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no {FMHA_V2_MODULE} on sys.path: build it with benchmarks/fmha_v2_site.py and "
                                "unpack it with benchmarks/gpu_env.sh")
    module = tvm_ffi.load_module(str(path))
    state: dict[str, Any] = {}

    def call(inputs: tuple[torch.Tensor, ...], layout: str, out: torch.Tensor, batch: int, tokens: int,
             bmm1: float, bmm2: float) -> None:
        if "workspace" not in state:
            state.update(workspace=torch.empty(FMHA_V2_WORKSPACE, dtype=torch.uint8, device=out.device),
                         lengths=torch.full((batch,), tokens, dtype=torch.int32, device=out.device),
                         starts=torch.arange(batch + 1, dtype=torch.int32, device=out.device) * tokens)
        with tvm_ffi.use_torch_stream():  # the kernel launches on torch's current stream (a graph's, in a capture)
            module.run(*inputs, out, state["workspace"], FMHA_V2_WORKSPACE, None, 0, state["lengths"],
                       state["starts"], state["starts"], layout, tokens, tokens, batch, "padding", 1.0, bmm1, bmm2,
                       -1, 0, False, 0.0, 0.0, None, None)

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any, str]:
        if not q.is_cuda:
            raise RuntimeError("FMHA v2 runs on a CUDA device only")
        if kind == "fp8_kernel":
            packed, scales = packed_e4m3(q, k, v)
            return (packed,) * 3, scales, "packed_qkv"
        return tuple(t.transpose(1, 2).flatten(0, 1).contiguous() for t in (q, k, v)), (1.0, 1.0, 1.0), "separate_q_k_v"

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            prepared: tuple[tuple[torch.Tensor, ...], Any, str]) -> torch.Tensor:
        inputs, (qs, ks, vs), layout = prepared
        batch, heads, tokens, dim = q.shape
        out = state.get("out")
        if out is None:
            out = state["out"] = torch.empty(batch * tokens, heads, dim, dtype=torch.bfloat16, device=q.device)
        call(inputs, layout, out, batch, tokens, qs * ks * dim ** -0.5, vs)
        return out.unflatten(0, (batch, tokens)).transpose(1, 2)
    return prepared_once(prepare, run)


def fa3_fn(fp8: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """FlashAttention-3's own Hopper forward (`flash_attn_interface`, prebuilt by benchmarks/fa3_site.py) on
    `[B, H, N, D]` inputs, bf16 out as a `[B, H, N, D]` view of its `[B, N, H, D]` output. With `fp8`, its e4m3
    kernel alone on inputs quantized once by `flashinfer_fa3.quantize` (Q, smoothed K and V, a scale per head), the
    codes FlashInfer's port of the same kernel is fed (`flashinfer_fp8_kernel`); else its bf16 kernel on inputs laid
    out as `[B, N, H, D]` once. Raises where the module is missing or off a CUDA device."""
    from flash_attn_interface import flash_attn_func

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        if not q.is_cuda:
            raise RuntimeError("FlashAttention-3 runs on a CUDA device only")
        if not fp8:
            return [t.transpose(1, 2).contiguous() for t in (q, k, v)], {}
        from hookkit.techniques.attention import flashinfer_fa3  # FlashInfer's port is fed the same codes and scales

        *codes, q_scale, k_scale, v_scale = flashinfer_fa3.quantize(q, k, v)
        return ([t.transpose(1, 2).contiguous() for t in codes],
                {"q_descale": q_scale.contiguous(), "k_descale": k_scale.contiguous(),
                 "v_descale": v_scale.contiguous()})

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            prepared: tuple[list[torch.Tensor], dict[str, torch.Tensor]]) -> torch.Tensor:
        inputs, descale = prepared
        out = flash_attn_func(*inputs, softmax_scale=q.shape[-1] ** -0.5, causal=False, **descale)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return prepared_once(prepare, run)


def _times_ms(fn: Callable[[], Any], repeats: int, warmup: int, device: str, graphs: bool) -> tuple[list[float], str]:
    if graphs or device == "cpu":
        timed = time_graph_replays(fn, repeats, warmup, device=device)
        return timed.times_ms, timed.how
    return time_calls(fn, repeats, warmup), EVENTS_PLAIN


def measure(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor,
            args: argparse.Namespace) -> dict[str, Any]:
    batch, heads, tokens, dim = q.shape
    row: dict[str, Any] = {"kernel": name, "batch": batch, "heads": heads, "tokens": tokens, "dim": dim,
                           "error": None, "times_ms": []}
    try:
        fn = kernel_fn(name)
        out = fn(q, k, v)
        err = (out.float() - ref).abs()
        row["max_abs_error"] = err.max().item()
        row["mean_rel_error"] = (err.mean() / ref.abs().mean()).item()
        times, how = _times_ms(lambda: fn(q, k, v), args.repeats, args.warmup, args.device, not args.no_graphs)
        spread = summary(times)
        flops = 4 * batch * tokens * tokens * heads * dim
        row.update(times_ms=times, timing=how, **spread, tflops=flops / (spread["median_ms"] * 1e-3) / 1e12)
    except Exception as error:  # noqa: BLE001 - every kernel is reported, whatever the others do
        row["error"] = f"{type(error).__name__}: {error}"
        row["traceback"] = traceback.format_exc(limit=3)
    return row


def fp32_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v in float32, one head at a time (the whole score matrix of 40 heads at 32,760 tokens
    would not fit)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        qh, kh, vh = (t[:, h:h + 1].float() for t in (q, k, v))
        out[:, h:h + 1] = F.scaled_dot_product_attention(qh, kh, vh)
    return out


def use_flashinfer_modules(folder: Path) -> None:
    """Point FlashInfer at `folder` for its prebuilt modules (its `jit.env.FLASHINFER_AOT_DIR`, read at each module's
    load), before any module loads; a module it does not hold is compiled as usual."""
    if not folder.is_dir():
        raise SystemExit(f"--flashinfer-aot: expected a folder of prebuilt FlashInfer modules, got {folder}")
    import flashinfer.jit.env as jit_env

    jit_env.FLASHINFER_AOT_DIR = folder.resolve()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.flashinfer_aot is not None:
        use_flashinfer_modules(args.flashinfer_aot)
    results: list[dict[str, Any]] = []
    for heads in args.heads:
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(args.batch, heads, args.tokens, args.dim, device=device, generator=g,
                               dtype=torch.bfloat16) for _ in range(3))
        ref = fp32_reference(q, k, v)
        for name in args.kernels:
            results.append(measure(name, q, k, v, ref, args))
            row = results[-1]  # as it comes: a kernel that ends the process leaves the rows before it in the log
            print(f"measured {name} x {heads} heads: " + (f"failed: {row['error'][:120]}" if row["error"] else
                  f"{row['median_ms']:.3f} ms, mean rel error {row['mean_rel_error']:.2e}"), flush=True)
        del q, k, v, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header = f"{'kernel':<14} {'heads':>5} {'tokens':>7} {'median ms':>10} {'min-max ms':>17} {'TFLOP/s':>8} " \
             f"{'max abs':>9} {'mean rel':>9}"
    print(header)
    for r in results:
        if r["error"] is not None:
            print(f"{r['kernel']:<14} {r['heads']:>5} {r['tokens']:>7}  failed: {r['error'][:80]}")
            continue
        print(f"{r['kernel']:<14} {r['heads']:>5} {r['tokens']:>7} {r['median_ms']:>10.3f} "
              f"{r['min_ms']:>8.3f}-{r['max_ms']:<8.3f} {r['tflops']:>8.1f} {r['max_abs_error']:>9.2e} "
              f"{r['mean_rel_error']:>9.2e}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "argv": sys.argv[1:] if argv is None else argv,
                "flashinfer_aot": None if args.flashinfer_aot is None else str(args.flashinfer_aot),
                "flops_formula": "4 * batch * N^2 * heads * dim"}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
