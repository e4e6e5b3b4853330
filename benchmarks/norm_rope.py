"""hookkit's query/key RMSNorm + RoPE kernel against inductor's kernels for it: Flux-dev and Qwen-Image at 1024², Wan.

Cases (bf16, query and key, batch 1; 24 heads of 128 but Wan's):
  flux-single  4,608 tokens: torch's rms_norm, then diffusers' interleaved real RoPE ([tokens, 128] tables)
  flux-double  text 512 + image 4,096 tokens, each normalized with its own weight, concatenated, then rotated
  qwen         text 512 + image 4,096 tokens: diffusers' RMSNorm (bf16 weight), complex RoPE, concatenated after
  wan          Wan 2.1 14B at 480x832, 81 frames: 32,760 tokens of 40 heads, torch's rms_norm over all heads, Wan's
               own RoPE with bf16 tables (a bf16 model's rope buffers); the pass leaves 40 heads to inductor
               (`norm_rope.MAX_ACROSS_WIDTH`): its `hookkit` row is inductor's, the op rows time the kernel
Rows per case: `inductor` (the eager function compiled with hookkit's other passes: RealComplexMul for qwen),
`hookkit` (compiled with FusedNormRope chained after it: one op call per query or key), and the op's kernel variants
called directly (`warps`; `int`: integer bf16 rounding instead of the PTX instruction; for Wan also the chunked
kernel, `chunked N heads`, which the op runs where a token is wider than `norm_rope.MAX_ONE_PROGRAM_WIDTH`). Each row: GPU time per call,
from CUDA-event timings of a CUDA graph that replays --iters calls (median of --runs replays after warm-up, min-max):
the kernels alone, as a captured transformer runs them (calls timed from Python would measure the host's launch path,
the op's wrapper and Triton's launcher, not the kernels), the memory traffic that implies, and the output against the
eager arithmetic (fraction of values moved, largest difference). Also the AdaLN fp8 kernel (compile.fp8_rows) with PTX and with integer rounding,
and its float32 form at Wan 2.1 14B's AdaLN input against inductor's kernels (`wan-adaln-fp8`), each kernel also with
each of `--adaln-rows` tokens a program (`fp8_rows_triton.quantize_layer_norm(rows_per_program=...)`: the modulation
rows loaded once for that many tokens).

    python benchmarks/norm_rope.py --out DIR        # a CUDA device; JSON in DIR/norm_rope.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import time_graph_replays  # noqa: E402
from diffusers.models.embeddings import apply_rotary_emb  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen  # noqa: E402

from hookkit.techniques.compile import fp8_rows, norm_rope  # noqa: E402
from hookkit.techniques.compile.norm_rope import FusedNormRope  # noqa: E402
from hookkit.techniques.compile.real_rope import RealComplexMul  # noqa: E402

HEADS, DIM, EPS = 24, 128, 1e-6
#: Wan 2.1 14B at 480x832, 81 frames (21 latent frames of 30 x 52 patches): 32,760 tokens of 40 heads
WAN_HEADS, WAN_TOKENS = 40, 32760


def diffusers_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm with a bf16 weight (Qwen-Image's norm_q / norm_k)."""
    inverse = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    return (x * inverse).to(x.dtype) * w


def flux_single(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(apply_rotary_emb(F.rms_norm(t, (DIM,), w, EPS), (cos, sin), sequence_dim=1)
                 for t, w in ((q, wq), (k, wk)))


def flux_double(q: torch.Tensor, k: torch.Tensor, tq: torch.Tensor, tk: torch.Tensor, w: list[torch.Tensor],
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for image, text, wi, wt in ((q, tq, w[0], w[1]), (k, tk, w[2], w[3])):
        joined = torch.cat([F.rms_norm(text, (DIM,), wt, EPS), F.rms_norm(image, (DIM,), wi, EPS)], dim=1)
        out.append(apply_rotary_emb(joined, (cos, sin), sequence_dim=1))
    return tuple(out)


def qwen(q: torch.Tensor, k: torch.Tensor, tq: torch.Tensor, tk: torch.Tensor, w: list[torch.Tensor],
         image_freqs: torch.Tensor, text_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for image, text, wi, wt in ((q, tq, w[0], w[1]), (k, tk, w[2], w[3])):
        out.append(torch.cat([apply_rotary_emb_qwen(diffusers_rms_norm(text, wt), text_freqs, use_real=False),
                              apply_rotary_emb_qwen(diffusers_rms_norm(image, wi), image_freqs, use_real=False)], dim=1))
    return tuple(out)


def wan(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's query and key paths (`WanAttnProcessor`): RMSNorm over all heads, then its own rotary embedding."""
    out = []
    for t, w in ((q, wq), (k, wk)):
        y = F.rms_norm(t, (t.shape[-1],), w, EPS).unflatten(2, (WAN_HEADS, -1))
        x1, x2 = y.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[..., 0::2], sin[..., 1::2]
        rotated = torch.empty_like(y)
        rotated[..., 0::2] = x1 * c - x2 * s
        rotated[..., 1::2] = x1 * s + x2 * c
        out.append(rotated.type_as(y))
    return tuple(out)


def case(name: str, device: torch.device) -> tuple[Callable[..., Any], tuple[Any, ...], list[dict[str, Any]]]:
    """(eager function, its inputs, the op's arguments for the query and for the key)."""
    g = torch.Generator(device).manual_seed(0)

    def x(tokens: int) -> torch.Tensor:
        return (torch.randn(1, tokens, HEADS * DIM * 3, device=device, generator=g) * 3).to(torch.bfloat16)[
            ..., :HEADS * DIM].unflatten(-1, (HEADS, DIM))  # a slice of a fused QKV output, as projections give it

    if name == "wan":  # separate projections (contiguous); bf16 tables, as a bf16 model's rope buffers are
        q, k = ((torch.randn(1, WAN_TOKENS, WAN_HEADS * DIM, device=device, generator=g) * 3).to(torch.bfloat16)
                for _ in range(2))
        wq, wk = ((torch.randn(WAN_HEADS * DIM, device=device, generator=g) * 0.5 + 1).to(torch.bfloat16)
                  for _ in range(2))
        cos, sin = (torch.randn(1, WAN_TOKENS, 1, DIM, device=device, generator=g).to(torch.bfloat16) for _ in range(2))
        return wan, (q, k, wq, wk, cos, sin), [
            dict(xs=[t.unflatten(-1, (WAN_HEADS, DIM))], weights=[w], eps=[EPS], cos=[cos[0, :, 0, 0::2]],
                 sin=[sin[0, :, 0, 1::2]], round_first=False, across_heads=True) for t, w in ((q, wq), (k, wk))]
    weights = [(torch.randn(DIM, device=device, generator=g) * 0.5 + 1).to(torch.bfloat16) for _ in range(4)]
    if name == "flux-single":
        q, k = x(4608), x(4608)
        cos, sin = torch.randn(4608, DIM, device=device, generator=g), torch.randn(4608, DIM, device=device, generator=g)
        return flux_single, (q, k, weights[0], weights[1], cos, sin), [
            dict(xs=[t], weights=[w], eps=[EPS], cos=[cos], sin=[sin], round_first=False)
            for t, w in ((q, weights[0]), (k, weights[1]))]
    q, k, tq, tk = x(4096), x(4096), x(512), x(512)
    if name == "flux-double":
        cos, sin = torch.randn(4608, DIM, device=device, generator=g), torch.randn(4608, DIM, device=device, generator=g)
        return flux_double, (q, k, tq, tk, weights, cos, sin), [
            dict(xs=[text, image], weights=[wt, wi], eps=[EPS, EPS], cos=[cos[:512], cos[512:]],
                 sin=[sin[:512], sin[512:]], round_first=False)
            for image, text, wi, wt in ((q, tq, weights[0], weights[1]), (k, tk, weights[2], weights[3]))]
    image_freqs = torch.polar(torch.ones(4096, DIM // 2, device=device),
                              torch.randn(4096, DIM // 2, device=device, generator=g))
    text_freqs = torch.polar(torch.ones(512, DIM // 2, device=device), torch.randn(512, DIM // 2, device=device, generator=g))
    fi, ft = torch.view_as_real(image_freqs), torch.view_as_real(text_freqs)
    return qwen, (q, k, tq, tk, weights, image_freqs, text_freqs), [
        dict(xs=[text, image], weights=[wt, wi], eps=[EPS, EPS], cos=[ft[..., 0], fi[..., 0]],
             sin=[ft[..., 1], fi[..., 1]], round_first=True)
        for image, text, wi, wt in ((q, tq, weights[0], weights[1]), (k, tk, weights[2], weights[3]))]


def timed_us(fn: Callable[[], Any], iters: int, runs: int) -> list[float]:
    """Per-call GPU time (µs) of `fn`: a CUDA graph of `iters` calls (captured after 3 warm-up calls), replayed `runs`
    times, each replay timed by CUDA events. No host work is timed; a capture that fails is an error."""
    timed = time_graph_replays(fn, runs, 3, calls_per_replay=iters, fallback=False)
    return [ms * 1e3 for ms in timed.times_ms]


def compare(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> dict[str, float]:
    moved = sum(int((o != r).sum()) for o, r in zip(out, ref, strict=True)) / sum(r.numel() for r in ref)
    largest = max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref, strict=True))
    return {"moved": moved, "max_abs_diff": largest}


def row(name: str, fn: Callable[[], Any], ref: tuple[torch.Tensor, ...], traffic: int, args: argparse.Namespace
        ) -> dict[str, Any]:
    times = timed_us(fn, args.iters, args.runs)
    med = statistics.median(times)
    out = fn()
    return {"row": name, "us": med, "us_min": min(times), "us_max": max(times), "tb_per_s": traffic / med / 1e6,
            **compare(tuple(out), ref)}


def norm_rope_rows(name: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    fn, inputs, calls = case(name, device)
    ref = tuple(norm_rope._reference(**c) for c in calls)  # the eager arithmetic (on the GPU: eager CUDA kernels)
    traffic = sum(2 * sum(x.numel() for x in c["xs"]) * 2 for c in calls)  # read and write bf16, query and key
    rows = []
    for label, rope in (("inductor", False), ("hookkit", True)):
        torch._dynamo.reset()
        fused = FusedNormRope() if rope else None
        pre = RealComplexMul(then=fused) if name == "qwen" else fused
        compiled = torch.compile(fn, options={"fx_graph_cache": False, **({"post_grad_custom_pre_pass": pre} if pre else {})})
        rows.append(row(label, lambda: compiled(*inputs), ref, traffic, args) | {"fused": fused.rewritten if fused else 0})
    from hookkit.techniques.compile import norm_rope_triton

    for warps in (2, 4, 8, 16):
        for use_ptx in (True, False):
            if not use_ptx and warps != 4 or warps == 16 and name != "wan":  # 16 warps: Wan's 64 (40) heads only
                continue

            def direct(warps: int = warps, use_ptx: bool = use_ptx) -> tuple[torch.Tensor, ...]:
                outs = []
                for c in calls:
                    xs = [x if x.stride(3) == 1 and x.stride(2) == DIM else x.contiguous() for x in c["xs"]]
                    out = xs[0].new_empty([1, sum(x.shape[1] for x in xs), xs[0].shape[2], DIM])
                    norm_rope_triton.launch(xs, c["weights"], c["eps"], c["cos"], c["sin"], c["round_first"], out,
                                            c.get("across_heads", False), num_warps=warps, use_ptx=use_ptx)
                    outs.append(out)
                return tuple(outs)

            label = f"op warps={warps}" + ("" if use_ptx else " int")
            rows.append(row(label, direct, ref, traffic, args))
    for chunk in (4, 8, 16) if any(c.get("across_heads", False) for c in calls) else ():
        for warps in (4, 8):
            def chunked(warps: int = warps, chunk: int = chunk) -> tuple[torch.Tensor, ...]:
                outs = []
                for c in calls:
                    out = c["xs"][0].new_empty(c["xs"][0].shape)
                    norm_rope_triton.launch([x.contiguous() for x in c["xs"]], c["weights"], c["eps"], c["cos"],
                                            c["sin"], c["round_first"], out, True, num_warps=warps, chunk_heads=chunk)
                    outs.append(out)
                return tuple(outs)

            rows.append(row(f"op chunked {chunk} heads warps={warps}", chunked, ref, traffic, args))
    return [r | {"case": name} for r in rows]


def layer_norm_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    from hookkit.techniques.compile import fp8_rows_triton

    g = torch.Generator(device).manual_seed(0)
    h = (torch.randn(1, 4608, 3072, device=device, generator=g) * 4 + 1).to(torch.bfloat16)
    a = (1 + torch.randn(1, 1, 3072, device=device, generator=g)).to(torch.bfloat16)
    b = torch.randn(1, 1, 3072, device=device, generator=g).to(torch.bfloat16)
    ref_data, ref_scale = fp8_rows._layer_norm_reference(h, a, b, EPS)
    traffic = h.numel() * 3  # bf16 read, fp8 written
    rows = []
    variants = [(True, None), (False, None)] + [(True, n) for n in args.adaln_rows]
    for use_ptx, per_program in variants:
        fn = lambda use_ptx=use_ptx, n=per_program: fp8_rows_triton.quantize_layer_norm(  # noqa: E731
            h, a, b, EPS, use_ptx=use_ptx, rows_per_program=n, floor=fp8_rows.floor_in(h.dtype))
        times = timed_us(fn, args.iters, args.runs)
        data, scale = fn()
        name = ("ptx" if use_ptx else "int") + ("" if per_program is None else f", {per_program} tokens a program")
        rows.append({"case": "adaln-fp8", "row": name, "us": statistics.median(times),
                     "us_min": min(times), "us_max": max(times), "tb_per_s": traffic / statistics.median(times) / 1e6,
                     "scales_moved": (scale != ref_scale).float().mean().item(),
                     "codes_moved": (data.view(torch.uint8) != ref_data.view(torch.uint8)).float().mean().item()})
    return rows


def wan_layer_norm_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Wan 2.1 14B's AdaLN input at 480x832x81 (32,760 tokens of 5,120, float32 modulation rows): hookkit's kernel
    (`fp8_quantize_float_layer_norm_rows`) against inductor's kernels for the same expression and torchao's
    quantization, compiled as regional `Compile` compiles a block without the pass."""
    from hookkit.techniques.compile import fp8_rows_triton

    g = torch.Generator(device).manual_seed(0)
    h = (torch.randn(1, 32760, 5120, device=device, generator=g) * 4 + 1).to(torch.bfloat16)
    a = 1 + torch.randn(1, 1, 5120, device=device, generator=g)
    b = torch.randn(1, 1, 5120, device=device, generator=g)
    ref_data, ref_scale = fp8_rows._float_layer_norm_reference(h, a, b, EPS)

    traffic = h.numel() * 3  # bf16 read, fp8 written
    variants = {"inductor": torch.compile(lambda: fp8_rows._float_layer_norm_reference(h, a, b, EPS), fullgraph=True),
                "kernel": lambda: fp8_rows_triton.quantize_layer_norm(h, a, b, EPS, rounded=False,
                                                                      floor=fp8_rows.floor_in(h.dtype))}
    for n in args.adaln_rows:
        variants[f"kernel, {n} tokens a program"] = lambda n=n: fp8_rows_triton.quantize_layer_norm(
            h, a, b, EPS, rounded=False, rows_per_program=n, floor=fp8_rows.floor_in(h.dtype))
    rows = []
    for name, fn in variants.items():
        times = timed_us(fn, args.iters, args.runs)
        data, scale = fn()
        rows.append({"case": "wan-adaln-fp8", "row": name, "us": statistics.median(times), "us_min": min(times),
                     "us_max": max(times), "tb_per_s": traffic / statistics.median(times) / 1e6,
                     "scales_moved": (scale.reshape(ref_scale.shape) != ref_scale).float().mean().item(),
                     "codes_moved": (data.reshape(ref_data.shape).view(torch.uint8)
                                     != ref_data.view(torch.uint8)).float().mean().item()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--cases", default="flux-single,flux-double,qwen,wan")
    parser.add_argument("--adaln-rows", type=lambda s: [int(n) for n in s.split(",")], default=[2, 4, 8, 16],
                        help="tokens a program of the AdaLN kernels to time besides the default (comma-separated)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/norm_rope.py needs a CUDA device (the kernels are Triton's)")
    device = torch.device("cuda")
    rows = layer_norm_rows(args, device) + wan_layer_norm_rows(args, device)
    for name in args.cases.split(","):
        rows += norm_rope_rows(name, args, device)
    for r in rows:
        print(json.dumps(r))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "norm_rope.json").write_text(json.dumps({
        "script": "benchmarks/norm_rope.py", "argv": sys.argv[1:], "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
