"""What hookkit keeps in memory that the peer does not, counted on the CPU.

1. Weights: the full-size transformers are built on the meta device (no memory) and hookkit's selection
   (`select_layers`) is applied with and without `Quantize(include_modulation=True)`, next to cache-dit's
   (every Linear inside the repeated blocks whose path contains none of "embedder", "embed", "modulation",
   "mod": `QuantizeConfig.exclude_layers`' default, substring matches). Bytes: bf16 = 2 per weight, per-row
   fp8 = 1 per weight + one float32 scale per output row.
2. Buffers of DBCache under whole-transformer graphs, measured on the tiny Flux with a CPU stand-in for
   capture (the bridge's residual slots, each graph's static inputs and outputs, the split mode's reference
   slots), checked against the per-slot formula (tokens x inner_dim x 2 bytes in bf16), and that formula
   evaluated at full size. What cannot be counted here is the CUDA graph pool (the intermediates of each
   captured graph, kept reserved between replays); the GPU queue reads it as `torch.cuda.memory_reserved`.

    python benchmarks/held_memory.py                 # ~20 s; writes $OUT/held_memory.{json,md}
    python benchmarks/held_memory.py --quick         # the same (it is CPU-only and small already)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hookkit
from hookkit.core.registry import HookRegistry
from hookkit.techniques.cache.hooks import graph_bridge
from hookkit.core.graphs import EagerCalls
from hookkit.techniques.compile.hooks import GRAPH, GraphHook, GraphRunner
from hookkit.techniques.quantize.torchao import select_layers
from hookkit.tools import bench, zoo

CACHE_DIT_EXCLUDE = ("embedder", "embed", "modulation", "mod")
GB = 1e9


def _fp8_bytes(in_f: int, out_f: int) -> int:
    return in_f * out_f + 4 * out_f


def weights(name: str) -> dict[str, Any]:
    with torch.device("meta"):
        saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            transformer = zoo.full_transformer(name)
        finally:
            torch.set_default_dtype(saved)
    adapter = hookkit.resolve_adapter(transformer)
    linears = {p: m for p, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    total = sum(p.numel() for p in transformer.parameters()) * 2
    classes = set(adapter.repeated_blocks)
    blocks = [p for p, m in transformer.named_modules() if type(m).__name__ in classes]
    inside = {q for q in linears if any(q.startswith(p + ".") for p in blocks)}

    def cost(paths: set[str]) -> dict[str, Any]:
        params = sum(linears[p].in_features * linears[p].out_features for p in paths)
        fp8 = sum(_fp8_bytes(linears[p].in_features, linears[p].out_features) for p in paths)
        return dict(layers=len(paths), params_b=params / 1e9, saved_gb=(2 * params - fp8) / GB,
                    total_after_gb=(total - 2 * params + fp8) / GB)

    default = {d.path for d in select_layers(transformer, hookkit.Quantize(scheme="fp8_row")).chosen}
    mod = {d.path for d in select_layers(transformer, hookkit.Quantize(scheme="fp8_row", include_modulation=True)).chosen}
    cache_dit = {p for p in inside if not any(x in p for x in CACHE_DIT_EXCLUDE)
                 and linears[p].in_features % 16 == 0 and linears[p].out_features % 16 == 0}
    return dict(model=name, bf16_total_gb=total / GB, hookkit_fp8_row=cost(default),
                hookkit_fp8_row_include_modulation=cost(mod), cache_dit_float8_per_row=cost(cache_dit),
                modulation_only=cost(mod - default), cache_dit_minus_hookkit_default=sorted(cache_dit - default)[:6],
                cache_dit_not_hookkit_count=len(cache_dit - default), hookkit_mod_not_cache_dit=len(mod - cache_dit))


class _ReplayBackend:
    """Capture = run once; replay = run again and copy into the static outputs (as tests/test_compile.py)."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge

    def capture(self, fn: Any) -> Any:
        forced = self.bridge.forced
        out = fn()

        def replay() -> None:
            last = {i: list(s) for i, s in self.bridge.last.items()}
            self.bridge.forced = forced
            try:
                fresh = fn()
            finally:
                self.bridge.forced, self.bridge.last = None, last
            for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(fresh)):
                a.copy_(b)
        return replay, out


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def tiny_buffers() -> dict[str, Any]:
    """Bytes held by the static-mask graphs on the tiny Flux (float32), and the formula's prediction."""
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(steps_mask="fast", mask_policy="static",
                                                                     taylorseer_order=0)))
    bridge = graph_bridge(handle)
    runner = GraphRunner(_ReplayBackend(bridge))
    # as Compile(cuda_graphs="transformer") attaches it: the first-call check's call runs uncaptured
    HookRegistry.of(pipe.transformer).register(GRAPH, GraphHook(runner, bridge, eager=handle.service(EagerCalls)))
    kwargs = zoo.call_kwargs("flux", steps=6)
    pipe(**kwargs)
    cfg = pipe.transformer.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    image_tokens = kwargs["latents"].shape[1] if "latents" in kwargs else None
    slots = {str(k[1:3]): v.numel() * v.element_size() for k, v in bridge.slots.items()}
    statics = [dict(inputs=_nbytes(e.static_leaves), output=_nbytes(e.static_output)) for e in runner.captured.values()]
    hidden_slot = next(v for k, v in bridge.slots.items() if k[1] == 0)
    return dict(inner_dim=inner, slot_shapes={str(k[1:3]): list(v.shape) for k, v in bridge.slots.items()},
                slot_bytes=slots, per_graph_static_bytes=statics,
                formula_hidden_slot_bytes=hidden_slot.shape[1] * inner * hidden_slot.element_size(),
                measured_hidden_slot_bytes=hidden_slot.numel() * hidden_slot.element_size(),
                image_tokens=image_tokens)


def full_buffers(size: int, text_tokens: int = 512, inner: int = 3072, in_channels: int = 64,
                 joint_dim: int = 4096, itemsize: int = 2) -> dict[str, Any]:
    """Full-size Flux-dev at `size`², bf16: DBCache residual slots per CFG branch, static inputs/outputs per graph."""
    image_tokens = (size // 16) ** 2
    hidden_slot = image_tokens * inner * itemsize
    encoder_slot = text_tokens * inner * itemsize
    inputs = (image_tokens * in_channels + text_tokens * joint_dim + 768 + 3) * itemsize + (image_tokens + text_tokens) * 3 * 4
    output = image_tokens * in_channels * itemsize
    static_graphs = 2  # computed-step and cached-step graph (static mask), per branch
    return dict(size=size, image_tokens=image_tokens,
                residual_slots_mb=(hidden_slot + encoder_slot) / 1e6,
                static_inputs_per_graph_mb=inputs / 1e6, static_output_per_graph_mb=output / 1e6,
                static_mask_total_mb=(hidden_slot + encoder_slot + static_graphs * (inputs + output)) / 1e6,
                split_dynamic_extra_mb=(hidden_slot + 2 * (inputs + output)) / 1e6)  # + reference slot, 2nd pair


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the same run (CPU-only and small already)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    doc = dict(script="benchmarks/held_memory.py", environment=bench.environment(torch.device("cpu")),
               weights=[weights("flux"), weights("qwenimage")], tiny_flux_buffers=tiny_buffers(),
               full_flux_buffers=[full_buffers(s) for s in (1024, 512, 256)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "held_memory.json").write_text(bench.to_json(doc, indent=2) + "\n")
    lines = ["| model | bf16 total (GB) | selection | layers | params (B) | saved by fp8 (GB) | after (GB) |",
             "|---|---|---|---|---|---|---|"]
    for w in doc["weights"]:
        for key in ("hookkit_fp8_row", "hookkit_fp8_row_include_modulation", "cache_dit_float8_per_row", "modulation_only"):
            c = w[key]
            lines.append(f"| {w['model']} | {w['bf16_total_gb']:.2f} | {key} | {c['layers']} | {c['params_b']:.3f} | "
                         f"{c['saved_gb']:.2f} | {c['total_after_gb']:.2f} |")
    lines += ["", "| Flux-dev size | residual slots / branch (MB) | static inputs / graph (MB) | static output / graph (MB) | "
              "static-mask total (MB) | split dynamic extra (MB) |", "|---|---|---|---|---|---|"]
    for b in doc["full_flux_buffers"]:
        lines.append(f"| {b['size']}² | {b['residual_slots_mb']:.1f} | {b['static_inputs_per_graph_mb']:.2f} | "
                     f"{b['static_output_per_graph_mb']:.2f} | {b['static_mask_total_mb']:.1f} | {b['split_dynamic_extra_mb']:.1f} |")
    t = doc["tiny_flux_buffers"]
    lines += ["", f"tiny Flux check: hidden residual slot measured {t['measured_hidden_slot_bytes']} B, formula "
                  f"{t['formula_hidden_slot_bytes']} B; slots {t['slot_shapes']}; per graph {t['per_graph_static_bytes']}"]
    text = "\n".join(lines)
    (out / "held_memory.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
