"""Per-head query/key RMSNorm and rotary embedding in one pass (`Compile(fuse_norm_rope=True)`, the default on CUDA).

`hookkit::rms_norm_rope` computes what diffusers' attention processors compute (bitwise on the CPU, where it is that
arithmetic); `FusedNormRope` finds the computation in inductor's graphs of Flux's and Qwen-Image's blocks; the Triton
kernel rounds where eager rounds (bitwise in Triton's CPU interpreter), and on a GPU stays within one rounding of it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock, apply_rotary_emb_qwen
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

import hookkit
from hookkit.errors import HookError
import hookkit.techniques.compile as compile_pkg
from hookkit.techniques.compile import norm_rope
from hookkit.techniques.compile.norm_rope import FusedNormRope, rms_norm_rope
from hookkit.techniques.compile.real_rope import RealComplexMul
from hookkit.tools import zoo

HEADS, DIM = 2, 64


def randn(*shape: int, seed: int = 0, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def head_weight(seed: int = 1) -> torch.Tensor:
    return (randn(DIM, seed=seed, scale=0.5) + 1).to(torch.bfloat16)


def flux_query(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's query path: torch's RMSNorm over the head, then the interleaved real rotary embedding."""
    return apply_rotary_emb(F.rms_norm(x, (x.shape[-1],), w, 1e-6), (cos, sin), sequence_dim=1)


def qwen_query(x: torch.Tensor, w: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's query path: diffusers' RMSNorm (bf16 weight), then the complex rotary embedding."""
    norm = RMSNorm(x.shape[-1], eps=1e-6).to(torch.bfloat16)
    norm.weight.data = w
    return apply_rotary_emb_qwen(norm(x), freqs, use_real=False)


def wan_query(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's query path (`WanAttnProcessor`): torch's RMSNorm over every head of a token, the heads split, then Wan's
    rotary embedding (its own code: even elements' cosines, odd elements' sines, written into an empty tensor)."""
    q = F.rms_norm(x, (x.shape[-1],), w, 1e-6).unflatten(2, (HEADS, -1))
    x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(q)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(q)


def wan_tables(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's `[1, tokens, 1, D]` tables (each value twice, as `repeat_interleave_real` writes them); in a bf16 model
    `.to(torch.bfloat16)` makes them bf16."""
    cos, sin = (randn(tokens, DIM // 2, seed=seed).repeat_interleave(2, dim=1) for seed in (2, 3))
    return cos.view(1, tokens, 1, DIM).to(dtype), sin.view(1, tokens, 1, DIM).to(dtype)


def rotation(tokens: int, seed: int = 3) -> torch.Tensor:
    return torch.polar(torch.ones(tokens, DIM // 2), randn(tokens, DIM // 2, seed=seed))


# --- the op: diffusers' arithmetic --------------------------------------------------------------------------


def test_the_op_is_fluxs_query_path_bitwise() -> None:
    x = randn(2, 24, HEADS, DIM, scale=3, dtype=torch.bfloat16)
    cos, sin = randn(24, DIM, seed=2), randn(24, DIM, seed=3)
    out = rms_norm_rope([x], [head_weight()], [1e-6], [cos], [sin], False)
    assert torch.equal(out, flux_query(x, head_weight(), cos, sin))


def test_the_op_is_qwen_images_query_path_bitwise() -> None:
    x = randn(2, 24, HEADS, DIM, scale=3, dtype=torch.bfloat16)
    freqs = rotation(24)
    real = torch.view_as_real(freqs)
    out = rms_norm_rope([x], [head_weight()], [1e-6], [real[..., 0]], [real[..., 1]], True)
    assert torch.equal(out, qwen_query(x, head_weight(), freqs))


@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])
def test_the_op_is_wans_query_path_bitwise(tables: torch.dtype) -> None:
    # the norm over all heads (weight [heads * D]); float32 tables rotate in float32, bf16 ones in bf16 (every product
    # rounded), as eager does
    x = randn(1, 16, HEADS * DIM, scale=3, dtype=torch.bfloat16)
    w = (randn(HEADS * DIM, seed=1, scale=0.5) + 1).to(torch.bfloat16)
    cos, sin = wan_tables(16, tables)
    out = rms_norm_rope([x.unflatten(2, (HEADS, DIM))], [w], [1e-6], [cos[0, :, 0, 0::2]], [sin[0, :, 0, 1::2]],
                        False, True)
    assert torch.equal(out, wan_query(x, w, cos, sin))


def test_the_op_concatenates_its_streams_over_tokens() -> None:
    text, image = randn(1, 4, HEADS, DIM, dtype=torch.bfloat16), randn(1, 9, HEADS, DIM, seed=5, dtype=torch.bfloat16)
    cos, sin = randn(13, DIM, seed=2), randn(13, DIM, seed=3)
    w_text, w_image = head_weight(1), head_weight(2)
    out = rms_norm_rope([text, image], [w_text, w_image], [1e-6, 1e-6], [cos[:4], cos[4:]], [sin[:4], sin[4:]], False)
    joined = torch.cat([F.rms_norm(text, (DIM,), w_text, 1e-6), F.rms_norm(image, (DIM,), w_image, 1e-6)], dim=1)
    assert torch.equal(out, apply_rotary_emb(joined, (cos, sin), sequence_dim=1))


def test_the_op_refuses_a_table_of_the_wrong_length_by_name() -> None:
    x = randn(1, 8, HEADS, DIM, dtype=torch.bfloat16)
    with pytest.raises(HookError, match=r"hookkit::rms_norm_rope: stream 0: .* cos \(7, 64\)"):
        rms_norm_rope([x], [head_weight()], [1e-6], [randn(7, DIM)], [randn(7, DIM)], False)


# --- the graph pass ----------------------------------------------------------------------------------------


def compiled(fn: Callable[..., Any], *inputs: Any, dynamic: bool | None = None) -> tuple[Any, FusedNormRope]:
    """fn compiled by inductor with the real-rope pass chained to a CPU norm-rope pass: (output, the norm-rope pass)."""
    torch._dynamo.reset()
    fused = FusedNormRope(devices=("cpu",))
    options = {"fx_graph_cache": False, "post_grad_custom_pre_pass": RealComplexMul(then=fused)}
    with torch.no_grad():
        return torch.compile(fn, options=options, dynamic=dynamic)(*inputs), fused


def test_fluxs_query_path_compiles_to_one_op_call_with_eagers_output() -> None:
    x = randn(1, 16, HEADS, DIM, scale=3, dtype=torch.bfloat16)
    cos, sin = randn(16, DIM, seed=2), randn(16, DIM, seed=3)
    out, fused = compiled(flux_query, x, head_weight(), cos, sin)
    assert fused.per_graph == [1]
    assert torch.equal(out, flux_query(x, head_weight(), cos, sin))  # on the CPU the op is the eager arithmetic


def test_qwen_images_query_path_compiles_to_one_op_call_with_eagers_output() -> None:
    x = randn(1, 16, HEADS, DIM, scale=3, dtype=torch.bfloat16)
    freqs = rotation(16)
    out, fused = compiled(qwen_query, x, head_weight(), freqs)
    assert fused.per_graph == [1]
    assert torch.equal(out, qwen_query(x, head_weight(), freqs))


@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])
def test_wans_query_path_compiles_to_one_op_call_with_eagers_output(tables: torch.dtype) -> None:
    x = randn(1, 16, HEADS * DIM, scale=3, dtype=torch.bfloat16)
    w = (randn(HEADS * DIM, seed=1, scale=0.5) + 1).to(torch.bfloat16)
    out, fused = compiled(wan_query, x, w, *wan_tables(16, tables))
    assert fused.per_graph == [1]
    assert torch.equal(out, wan_query(x, w, *wan_tables(16, tables)))


def test_a_norm_over_more_heads_than_the_kernel_is_measured_faster_for_is_left_to_inductor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # HEADS (2) x DIM (64) = 128 values a token: fused at the limit, left alone one head-row below it
    x = randn(1, 16, HEADS * DIM, scale=3, dtype=torch.bfloat16)
    w = (randn(HEADS * DIM, seed=1, scale=0.5) + 1).to(torch.bfloat16)
    monkeypatch.setattr(norm_rope, "MAX_ACROSS_WIDTH", HEADS * DIM)
    assert compiled(wan_query, x, w, *wan_tables(16, torch.float32))[1].per_graph == [1]
    monkeypatch.setattr(norm_rope, "MAX_ACROSS_WIDTH", HEADS * DIM - 1)
    assert compiled(wan_query, x, w, *wan_tables(16, torch.float32))[1].per_graph == [0]


def test_a_per_head_weight_with_a_norm_over_all_heads_is_refused_by_name() -> None:
    x = randn(1, 4, HEADS, DIM, dtype=torch.bfloat16)
    with pytest.raises(HookError, match=r"hookkit::rms_norm_rope: stream 0: .*weight \[heads \* D\].*got .*weight \(64,\)"):
        rms_norm_rope([x], [head_weight()], [1e-6], [randn(4, DIM // 2)], [randn(4, DIM // 2)], False, True)


def test_symbolic_shapes_are_left_to_inductor() -> None:
    x = randn(1, 16, HEADS, DIM, dtype=torch.bfloat16)
    _, fused = compiled(flux_query, x, head_weight(), randn(16, DIM), randn(16, DIM), dynamic=True)
    assert fused.per_graph == [0]


def test_a_norm_without_weight_is_left_to_inductor() -> None:
    def unweighted(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_emb(F.rms_norm(x, (x.shape[-1],), None, 1e-6), (cos, sin), sequence_dim=1)

    _, fused = compiled(unweighted, randn(1, 16, HEADS, DIM, dtype=torch.bfloat16), randn(16, DIM), randn(16, DIM))
    assert fused.per_graph == [0]


def weighted_block(block: torch.nn.Module) -> torch.nn.Module:
    """A tiny bf16 block whose query/key norm weights are not all ones (an all-ones weight would hide a dropped one)."""
    block = block.to(torch.bfloat16).eval()
    for name, p in block.named_parameters():
        if ".norm_q" in name or ".norm_k" in name or ".norm_added" in name:
            p.data = (randn(*p.shape, seed=len(name), scale=0.5) + 1).to(p.dtype)
    return block


def block_case(kind: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(call, inputs) of one tiny block with 16 image and 4 text tokens."""
    torch.manual_seed(0)
    width = HEADS * DIM
    hidden, context = randn(1, 16, width, dtype=torch.bfloat16), randn(1, 4, width, seed=1, dtype=torch.bfloat16)
    temb = randn(1, width, seed=2, dtype=torch.bfloat16)
    if kind == "wan":  # self-attention rotates (one call each for query and key), cross-attention does not
        block = weighted_block(WanTransformerBlock(dim=width, ffn_dim=32, num_heads=HEADS))
        return (lambda h, c, t, cos, sin: block(h, c, t, (cos, sin))), (
            hidden, context, randn(1, 6, width, seed=2, dtype=torch.bfloat16), *wan_tables(16, torch.bfloat16))
    if kind == "qwen":
        block = weighted_block(QwenImageTransformerBlock(dim=width, num_attention_heads=HEADS, attention_head_dim=DIM))
        return (lambda h, c, t, fi, ft: block(h, c, None, t, image_rotary_emb=(fi, ft))[1]), (
            hidden, context, temb, rotation(16), rotation(4, seed=4))
    cls = FluxTransformerBlock if kind == "flux-double" else FluxSingleTransformerBlock
    block = weighted_block(cls(dim=width, num_attention_heads=HEADS, attention_head_dim=DIM))
    return (lambda h, c, t, cos, sin: block(h, c, temb=t, image_rotary_emb=(cos, sin))[1]), (
        hidden, context, temb, randn(20, DIM, seed=3), randn(20, DIM, seed=4))


@pytest.mark.parametrize("kind", ["flux-single", "flux-double", "qwen"])
def test_a_blocks_query_and_key_each_become_one_op_call(kind: str) -> None:
    # Flux's double block concatenates text and image before the rotation, Qwen-Image's after: one call either way
    call, inputs = block_case(kind)
    out, fused = compiled(call, *inputs)
    assert fused.per_graph == [2]
    torch._dynamo.reset()
    with torch.no_grad():
        reference = torch.compile(call, options={"fx_graph_cache": False, "post_grad_custom_pre_pass": RealComplexMul()})(
            *inputs)
    torch.testing.assert_close(out.float(), reference.float(), rtol=0, atol=3e-2)  # inductor's own rounding differs


def test_a_wan_blocks_query_and_key_each_become_one_op_call_within_one_bf16_step_of_eager() -> None:
    # the bf16 tables of a bf16 model: the op rounds each product as eager does, inductor's kernels do not (its output
    # is two bf16 steps from the op's at one of 2,048 values, one from eager's at either): compared with eager
    call, inputs = block_case("wan")
    out, fused = compiled(call, *inputs)
    assert fused.per_graph == [2]
    with torch.no_grad():
        eager = call(*inputs)
    assert eager.abs().max().item() < 8  # so that one bf16 step is at most 2 ** -5
    torch.testing.assert_close(out.float(), eager.float(), rtol=0, atol=2 ** -5)


# --- the feature ---------------------------------------------------------------------------------------------


def run_tiny(name: str, compile_: hookkit.Compile, device: str = "cpu") -> tuple[torch.Tensor, dict[str, Any]]:
    """A bf16 tiny pipeline's images (two steps) with `compile_`, and the compile feature's summary data. Wan: its
    latents (the tiny random VAE magnifies a bf16 step of them tenfold), with heads of 16 (the kernel holds heads of a
    power of two; the zoo's tiny Wan has 12)."""
    torch._dynamo.reset()
    wan = name == "wan"
    pipe = zoo.tiny_pipeline(name, **({"attention_head_dim": 16} if wan else {})).to(device, torch.bfloat16)
    kwargs = {k: v.to(device, torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in zoo.call_kwargs(name, steps=2, output_type="latent" if wan else "pt").items()}
    handle = hookkit.enable(pipe, hookkit.Spec(compile=compile_))
    try:
        with inductor_config.patch(fx_graph_cache=False):  # a graph served from the cache is not rewritten again
            output = pipe(**kwargs)
            images = output.frames if wan else output.images
        return images, handle.summary().features["compile"].data
    finally:
        handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux", "qwenimage", "wan"])
def test_compile_fuses_the_query_and_key_of_every_block_graph_of_a_tiny_pipeline(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm_rope, "DEVICES", ("cpu",))
    images, data = run_tiny(name, hookkit.Compile())
    reference, plain = run_tiny(name, hookkit.Compile(fuse_norm_rope=False))
    # a block class's graph serves all its blocks (dynamo compiles Flux's single block a second time for its guards):
    # each graph fuses its query and its key (Wan: its self-attention's; its cross-attention has no rotation)
    assert set(data["norm_ropes_per_graph"]) == {2} and len(data["norm_ropes_per_graph"]) == (3 if name == "flux" else 1)
    assert "norm_ropes_fused" not in plain
    if name == "wan":  # latents up to about 3.5: two bf16 steps
        assert images.abs().max().item() < 4
        torch.testing.assert_close(images.float(), reference.float(), rtol=0, atol=2 ** -4)
    else:
        torch.testing.assert_close(images.float(), reference.float(), rtol=0, atol=2e-2)


# --- the kernel's arithmetic in Triton's CPU interpreter --------------------------------------------------------

INTERPRETED = """
import json
import torch
from hookkit.techniques.compile import norm_rope, norm_rope_triton as kernels

g = torch.Generator().manual_seed(0)
batch, heads, dim = 2, 3, 128
found = {}
for round_first in (False, True):  # torch's rms_norm (Flux, [tokens, D] tables), diffusers' RMSNorm (Qwen, per pair)
    text = (torch.randn(batch, 5, heads, 2 * dim, generator=g) * 3).to(torch.bfloat16)[..., ::2].contiguous()
    image = torch.randn(batch, 7, heads, dim, generator=g).to(torch.bfloat16)
    weights = [(torch.randn(dim, generator=g) * 0.5 + 1).to(torch.bfloat16) for _ in range(2)]
    if round_first:
        tables = [torch.randn(n, dim // 2, 2, generator=g) for n in (5, 7)]
        cos, sin = [t[..., 0] for t in tables], [t[..., 1] for t in tables]
    else:
        c, s = torch.randn(12, dim, generator=g), torch.randn(12, dim, generator=g)
        cos, sin = [c[:5], c[5:]], [s[:5], s[5:]]
    ref = norm_rope._reference([text, image], weights, [1e-6, 1e-6], cos, sin, round_first)
    out = torch.empty(batch, 12, heads, dim, dtype=torch.bfloat16)
    kernels.launch([text, image], weights, [1e-6, 1e-6], cos, sin, round_first, out)
    found[str(round_first)] = [out.numel(), int((out == ref).sum())]
# Wan: one norm over the token's heads (weight [heads * D]), bf16 tables (even cosines, odd sines: strided halves)
x = (torch.randn(batch, 7, heads, dim, generator=g) * 3).to(torch.bfloat16)
w = (torch.randn(heads * dim, generator=g) * 0.5 + 1).to(torch.bfloat16)
cos, sin = (torch.randn(7, dim, generator=g).to(torch.bfloat16) for _ in range(2))
args = ([x], [w], [1e-6], [cos[:, 0::2]], [sin[:, 1::2]], False)
out = torch.empty(batch, 7, heads, dim, dtype=torch.bfloat16)
kernels.launch(*args, out, across_heads=True)
ref = norm_rope._reference(*args, across_heads=True)
found["across, bf16 tables"] = [out.numel(), int((out == ref).sum())]
# the chunked kernel (a token too wide for one program): 5 heads, 2 at a time (the last chunk half masked)
x = (torch.randn(batch, 7, 5, dim, generator=g) * 3).to(torch.bfloat16)
w = (torch.randn(5 * dim, generator=g) * 0.5 + 1).to(torch.bfloat16)
for round_first in (False, True):
    args = ([x], [w], [1e-6], [cos[:, 0::2]], [sin[:, 1::2]], round_first)
    out = torch.empty(batch, 7, 5, dim, dtype=torch.bfloat16)
    kernels.launch(*args, out, across_heads=True, chunk_heads=2)
    ref = norm_rope._reference(*args, across_heads=True)
    found[f"across, chunked, {round_first}"] = [out.numel(), int((out == ref).sum())]
print(json.dumps(found))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_the_kernel_is_the_ops_arithmetic_bitwise_in_tritons_interpreter(interpreted: Callable[[str], Any]) -> None:
    # the sum of squares, both RMSNorm roundings, both table layouts, two streams at their token offsets, on the CPU
    assert interpreted(INTERPRETED) == {"False": [9216, 9216], "True": [9216, 9216],
                                        "across, bf16 tables": [5376, 5376], "across, chunked, False": [8960, 8960],
                                        "across, chunked, True": [8960, 8960]}


def test_a_token_wider_than_one_program_is_normalized_four_heads_of_128_at_a_time() -> None:
    # Wan 2.1 14B's 40 heads of 128 (64 rounded up: 8,192 values) in 10 chunks; Wan 1.3B's 12 (16: 2,048) in one
    # program; heads of 64 eight at a time (512 values a chunk)
    assert (norm_rope.chunk_heads(40, 128), norm_rope.chunk_heads(12, 128), norm_rope.chunk_heads(40, 64)) == (4, None,
                                                                                                            8)


def test_the_pass_gives_wan_14bs_norm_over_forty_heads_to_the_op() -> None:
    # measured faster than inductor there (chunked, 4 heads at a time); a token of more than 64 heads of 128 is not
    assert norm_rope.padded_width(40, 128) <= norm_rope.MAX_ACROSS_WIDTH < norm_rope.padded_width(65, 128)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_chunked_kernel_takes_a_power_of_two_of_heads_for_a_norm_over_all_heads_only() -> None:
    from hookkit.techniques.compile import norm_rope_triton

    x = torch.zeros(1, 2, 5, 8, dtype=torch.bfloat16)
    table = torch.zeros(2, 4)
    for chunk, across in ((3, True), (2, False)):
        with pytest.raises(HookError, match=rf"chunk_heads expected a power of two with across_heads=True, got {chunk} "
                                            rf"\(across_heads={across}\)"):
            norm_rope_triton.launch([x], [torch.ones(40)], [1e-6], [table], [table], False, torch.empty_like(x),
                                    across, chunk_heads=chunk)


def test_the_op_runs_the_chunked_kernel_for_a_norm_over_forty_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    launches: list[dict[str, Any]] = []
    stand_in = types.ModuleType("hookkit.techniques.compile.norm_rope_triton")
    stand_in.launch = lambda *args, **kwargs: launches.append(kwargs)
    monkeypatch.setitem(sys.modules, "hookkit.techniques.compile.norm_rope_triton", stand_in)
    monkeypatch.setattr(compile_pkg, "norm_rope_triton", stand_in, raising=False)
    monkeypatch.setattr(norm_rope, "_kernel_fits", lambda xs: True)
    x = torch.zeros(1, 3, 40, 128, dtype=torch.bfloat16)
    table = torch.zeros(3, 64, dtype=torch.bfloat16)
    norm_rope.rms_norm_rope([x], [torch.ones(40 * 128, dtype=torch.bfloat16)], [1e-6], [table], [table], False, True)
    norm_rope.rms_norm_rope([x], [torch.ones(128, dtype=torch.bfloat16)], [1e-6], [table], [table], False, False)
    assert [k["chunk_heads"] for k in launches] == [4, None]


# --- GPU: the kernel at full size ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_within_one_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel sums the squares in another order than eager: a head's scale may move by one float32 ulp, so a
    value may move by one bf16 step, rarely."""
    moved = (out != ref).float().mean().item()
    assert moved < 1e-3, moved
    assert (out.float() - ref.float()).abs().max().item() <= 2 ** -6 * ref.float().abs().max().item()


def full_size_arguments(model: str) -> tuple[Any, ...]:
    """The op's arguments for one query at 1024²: Flux-dev's double block (512 text + 4,096 image tokens, the image a
    slice of a fused QKV output: rows strided; [tokens, 128] tables) or Qwen-Image's image stream (one table per pair);
    or one of Wan 2.1 14B's at 480x832 (a norm over 40 heads, bf16 tables: the chunked kernel)."""
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g)

    weights = [(randn(128) * 0.5 + 1).to(torch.bfloat16) for _ in range(2)]
    if model == "wan":  # Wan 2.1 14B at 480x832, 21 latent frames: 32,760 tokens of 40 heads; bf16 tables
        cos, sin = (randn(32760, 128).to(torch.bfloat16) for _ in range(2))
        return ([(randn(1, 32760, 40, 128) * 4).to(torch.bfloat16)], [(randn(40 * 128) * 0.5 + 1).to(torch.bfloat16)],
                [1e-6], [cos[:, 0::2]], [sin[:, 1::2]], False, True)
    if model == "qwenimage":
        table = randn(4096, 64, 2)
        return [(randn(1, 4096, 24, 128) * 4).to(torch.bfloat16)], weights[:1], [1e-6], [table[..., 0]], [table[..., 1]], True
    text = (randn(1, 512, 24, 128) * 4).to(torch.bfloat16)
    image = randn(1, 4096, 24 * 128 * 3).to(torch.bfloat16)[..., :3072].unflatten(-1, (24, 128))
    cos, sin = randn(4608, 128), randn(4608, 128)
    return [text, image], weights, [1e-6, 1e-6], [cos[:512], cos[512:]], [sin[:512], sin[512:]], False


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("model", ["flux", "qwenimage", "wan"])
def test_the_kernel_at_full_size_is_eagers_arithmetic_within_one_rounding(model: str) -> None:
    args = full_size_arguments(model)
    assert_within_one_rounding(rms_norm_rope(*args), norm_rope._reference(*args))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", ["flux", "qwenimage", "wan"])
def test_a_compiled_tiny_pipeline_with_the_kernel_stays_close_to_the_unfused_compile(name: str) -> None:
    images, data = run_tiny(name, hookkit.Compile(), device="cuda")
    reference, _ = run_tiny(name, hookkit.Compile(fuse_norm_rope=False), device="cuda")
    assert set(data["norm_ropes_per_graph"]) == {2} and len(data["norm_ropes_per_graph"]) == (3 if name == "flux" else 1)
    # inductor's kernels and hookkit's round the same values apart now and then (on an H200, one of 3,072 image values
    # of tiny Flux 0.023 apart after two steps): as close as the CPU's compiled blocks (Wan: latents, two bf16 steps)
    torch.testing.assert_close(images.float(), reference.float(), rtol=0, atol=2 ** -4 if name == "wan" else 3e-2)


# --- the benchmark measures what it names ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flux-single", "flux-double", "qwen", "wan"])
def test_each_benchmark_case_compiles_to_two_op_calls_that_match_its_eager_function(
        name: str, benchmark_script: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    script = benchmark_script("norm_rope")
    monkeypatch.setattr(script, "HEADS", 2)
    monkeypatch.setattr(script, "DIM", 16)
    monkeypatch.setattr(script, "WAN_HEADS", 3)
    monkeypatch.setattr(script, "WAN_TOKENS", 24)
    fn, inputs, calls = script.case(name, torch.device("cpu"))
    out, fused = compiled(fn, *inputs)
    assert fused.per_graph == [2]
    reference = tuple(norm_rope._reference(**call) for call in calls)  # what the benchmark compares the kernels with
    assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fn(*inputs), reference, strict=True))


@pytest.mark.slow
def test_the_coverage_script_finds_flux2s_queries_and_keys_and_their_output_matches_the_unfused_compile(
        benchmark_script: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Flux.2 shares Flux's attention forms: its double and single block graphs each fuse a query and a key
    coverage = benchmark_script("norm_rope_coverage")
    monkeypatch.setattr(norm_rope, "DEVICES", ("cpu",))
    out, data = coverage.run("Flux2Transformer", fuse=True)
    reference, plain = coverage.run("Flux2Transformer", fuse=False)
    assert data["norm_ropes_per_graph"] == [2, 2] and "norm_ropes_fused" not in plain
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-2)
