"""Complex rotary embeddings as real arithmetic in compiled regions (`Compile(real_rope=True)`, the default).

Inductor generates no code for complex operators; `RealComplexMul` rewrites `view_as_real(view_as_complex(x) * y)`
into the real formula ATen's complex product computes, so on the CPU the compiled output is bitwise the one the
complex path compiles to, and the generated code holds no complex kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
from torch._inductor.utils import run_and_get_code

import hookkit
from hookkit.techniques.compile.hooks import compile_kwargs
from hookkit.techniques.compile.real_rope import RealComplexMul
from hookkit.tools import zoo


def qwen_rope(q: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's query path: RMSNorm over the head dimension, then its complex rotary embedding."""
    return apply_rotary_emb_qwen(torch.nn.functional.rms_norm(q, (q.shape[-1],)), freqs, use_real=False)


def rope_inputs(seq: int = 32, heads: int = 2, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, dim, generator=g).to(torch.bfloat16)
    freqs = torch.polar(torch.ones(seq, dim // 2), torch.randn(seq, dim // 2, generator=g))
    return q, freqs


def compiled(fn, rope: RealComplexMul | None, *inputs: torch.Tensor, dynamic: bool | None = None
             ) -> tuple[torch.Tensor, str]:
    """fn compiled by inductor with `rope` as its post-grad pre-pass (or without one): (output, generated code)."""
    torch._dynamo.reset()
    options = {"fx_graph_cache": False} | ({"post_grad_custom_pre_pass": rope} if rope is not None else {})
    out, code = run_and_get_code(torch.compile(fn, options=options, dynamic=dynamic), *inputs)
    return out, "\n".join(code)


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "symbolic"])  # symbolic: automatic dynamic's recompile
def test_a_complex_rope_is_rewritten_and_gives_the_complex_paths_output_bitwise(dynamic: bool | None) -> None:
    q, freqs = rope_inputs()
    rope = RealComplexMul()
    out, _ = compiled(qwen_rope, rope, q, freqs, dynamic=dynamic)
    reference, _ = compiled(qwen_rope, None, q, freqs, dynamic=dynamic)
    assert rope.per_graph == [1]
    assert torch.equal(out, reference)


def test_the_rewritten_code_has_no_complex_kernel() -> None:
    q, freqs = rope_inputs()
    _, before = compiled(qwen_rope, None, q, freqs)
    _, after = compiled(qwen_rope, RealComplexMul(), q, freqs)
    assert "aten.view_as_complex" in before and "aten.mul.Tensor" in before  # ATen's complex product, unfused
    assert "aten.view_as_complex" not in after and "aten.mul.Tensor" not in after


def anyflow_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    from diffusers.models.transformers.transformer_anyflow import apply_rotary_emb

    return apply_rotary_emb(x, freqs[:, None].to(torch.complex128))  # AnyFlow rotates in float64


def sana_wm_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    from diffusers.models.transformers.transformer_sana_wm import _apply_rotary_emb

    return _apply_rotary_emb(x.permute(0, 2, 3, 1), freqs).permute(0, 3, 1, 2)  # takes (batch, heads, dim, seq)


def sana_wm_inverse_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return sana_wm_rope(x, freqs.conj())


@pytest.mark.parametrize("rope_fn", [anyflow_rope, sana_wm_rope, sana_wm_inverse_rope],
                         ids=["anyflow-float64", "sana-wm-permuted", "sana-wm-conjugated"])
def test_diffusers_other_complex_ropes_compile_to_the_complex_paths_output(rope_fn) -> None:
    q, freqs = rope_inputs()
    rope = RealComplexMul()
    out, _ = compiled(rope_fn, rope, q, freqs)
    reference, _ = compiled(rope_fn, None, q, freqs)
    assert rope.per_graph == [1]
    assert torch.equal(out, reference)
    torch.testing.assert_close(out, rope_fn(q, freqs), rtol=0, atol=1e-2)  # and eager's, up to bf16 rounding


def test_a_product_used_as_a_complex_tensor_is_left_alone() -> None:
    def magnitude(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return (torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs[:, None]).abs()

    q, freqs = rope_inputs()
    rope = RealComplexMul()
    out, _ = compiled(magnitude, rope, q, freqs)
    assert rope.per_graph == [0]
    torch.testing.assert_close(out, magnitude(q, freqs))


def test_a_product_of_different_complex_precisions_is_left_alone() -> None:
    def promoted(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs[:, None])

    q, freqs = rope_inputs()
    rope = RealComplexMul()
    out, _ = compiled(promoted, rope, q, freqs.to(torch.complex128))
    assert rope.per_graph == [0]
    assert out.dtype == torch.float64


def test_a_pre_pass_already_configured_runs_after_the_rewrite() -> None:
    seen: list[bool] = []

    def user_pass(graph: torch.fx.Graph) -> None:
        seen.append(any(n.target is torch.ops.aten.view_as_complex.default for n in graph.nodes))

    q, freqs = rope_inputs()
    compiled(qwen_rope, RealComplexMul(then=user_pass), q, freqs)
    assert seen == [False]  # the user's pass ran, on the rewritten graph


def test_the_cache_key_changes_with_the_chained_pass() -> None:
    assert RealComplexMul().uuid() == RealComplexMul().uuid()
    assert RealComplexMul(then=RealComplexMul()).uuid() != RealComplexMul().uuid()


def test_an_unquantized_compile_with_the_pass_spells_its_mode_as_options() -> None:
    rope = RealComplexMul()
    assert compile_kwargs(hookkit.Compile(mode="reduce-overhead"), real_rope=rope) == {
        "fullgraph": True, "dynamic": None, "backend": "inductor",
        "options": {"triton.cudagraphs": True, "post_grad_custom_pre_pass": rope}}


def test_a_quantized_compile_gets_the_pass_beside_torchaos_options() -> None:
    rope = RealComplexMul()
    options = compile_kwargs(hookkit.Compile(), quantized=True, real_rope=rope)["options"]
    assert options == {"force_fuse_int_mm_with_mul": True, "post_grad_custom_pre_pass": rope}


@pytest.mark.slow
def test_tiny_qwen_image_rewrites_its_four_products_per_block_graph_and_matches_the_complex_compile() -> None:
    def run(compile_: hookkit.Compile) -> tuple[torch.Tensor, dict]:
        torch._dynamo.reset()
        pipe = zoo.tiny_pipeline("qwenimage")
        handle = hookkit.enable(pipe, hookkit.Spec(compile=compile_))
        with inductor_config.patch(fx_graph_cache=False):  # a graph served from the cache is not rewritten again
            out = pipe(**zoo.call_kwargs("qwenimage", steps=2)).images
        data = handle.summary().features["compile"].data
        handle.remove()
        return out, data

    out, data = run(hookkit.Compile())
    reference, plain = run(hookkit.Compile(real_rope=False))
    # one block graph serves the three blocks: image and text queries and keys
    assert (data["complex_muls_as_real"], data["complex_muls_per_graph"]) == (4, [4])
    assert "complex_muls_as_real" not in plain
    assert torch.equal(out, reference)


def test_a_compile_leaves_the_process_wide_pre_pass_as_it_was() -> None:
    pipe = zoo.tiny_pipeline("qwenimage")
    handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile()))
    pipe(**zoo.call_kwargs("qwenimage", steps=1))
    handle.remove()
    assert inductor_config.post_grad_custom_pre_pass is None


# --- GPU (skipped without CUDA): inductor's Triton code for the rewritten graph -------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_compiled_qwen_image_with_real_rope_matches_the_complex_compile() -> None:
    outputs, counts = [], []
    for real_rope in (True, False):
        torch._dynamo.reset()
        pipe = zoo.tiny_pipeline("qwenimage").to("cuda", torch.bfloat16)
        kwargs = {k: v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                  for k, v in zoo.call_kwargs("qwenimage", steps=2, output_type="pt").items()}
        handle = hookkit.enable(pipe, hookkit.Spec(compile=hookkit.Compile(real_rope=real_rope)))
        with inductor_config.patch(fx_graph_cache=False):
            outputs.append(pipe(**kwargs).images)
        counts.append(handle.summary().features["compile"].data.get("complex_muls_as_real"))
        handle.remove()
    assert counts == [4, None]
    # Triton may contract a*c - b*d into an FMA where ATen's complex kernel does not: equal up to bf16 rounding
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=2e-2)
