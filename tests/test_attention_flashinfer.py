"""FlashInfer's FA3 attention as `Attention(kernel="flashinfer")` (bf16/fp16) and
`Attention(low_precision="flashinfer_fp8")`: hookkit's quantization (per-head e4m3 scales, K smoothed), the calls it
makes to FlashInfer, the ops under torch.compile, the build at enable, and the refusals.

On the CPU a stand-in `flashinfer` module (`flashinfer_stand_in.StandIn`) computes what FlashInfer's source says
`single_prefill_with_kv_cache` does and records each call, so the tests check hookkit's side of the contract: layouts, scales, one call per batch element, the output's layout. The kernel
itself runs in the GPU tests, which need the package and a Hopper GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hookkit
from bf16_calls import call_flux_bf16, relative_error
from flashinfer_stand_in import (StandIn, accumulating_p_v_in_limited_precision, applying_first_heads_scales,
                                 rounding_against_a_running_maximum)
from hookkit.errors import UnsupportedError
from hookkit.techniques.attention import flashinfer_fa3
from hookkit.techniques.attention.hooks import _sdpa_args, capability_refusal, head_sizes_ok, run_kernel, unsupported
from hookkit.tools import zoo

FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _qkv(batch: int = 2, heads: int = 3, tokens: int = 40, dim: int = 64, offset: float = 0.0,
         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, tokens, dim, generator=g) for _ in range(3))
    return q.to(dtype), (k + offset).to(dtype), v.to(dtype)


@pytest.fixture(autouse=True)
def short_fp8_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU tests check enable's logic at 120 tokens; the GPU tests run the check at its real length
    (`flashinfer_fa3.CHECK_TOKENS`: 8,192 keys for the fp8 kernel, whose scores the CPU would hold for seconds)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(flashinfer_fa3, "CHECK_TOKENS", {True: 120, False: 120})


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    module = StandIn()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _dequantized(q8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q8.float() * scales[:, :, None, None]


# --- quantization ------------------------------------------------------------------------------------------------


def test_scales_are_each_heads_amax_over_448() -> None:
    q, _, _ = _qkv()
    amax = q.float().abs().amax(dim=(2, 3))
    assert torch.equal(flashinfer_fa3.head_scales(q), amax / 448.0)


def test_quantized_values_are_within_half_an_e4m3_step_of_the_inputs() -> None:
    q, k, v = _qkv()
    q8, _, v8, q_scale, _, v_scale = flashinfer_fa3.quantize(q, k, v)
    assert q8.dtype == v8.dtype == torch.float8_e4m3fn and q8.shape == q.shape
    for t, t8, s in ((q, q8, q_scale), (v, v8, v_scale)):
        x = t.float()
        step = torch.maximum(x.abs() * 2.0 ** -4, s[:, :, None, None] * 2.0 ** -10)  # normals: 3 mantissa bits
        assert ((_dequantized(t8, s) - x).abs() <= step * (1 + 1e-6)).all()


def test_the_largest_value_of_each_head_maps_to_448() -> None:
    q, k, v = _qkv()
    q8 = flashinfer_fa3.quantize(q, k, v)[0]
    assert torch.equal(q8.float().abs().amax(dim=(2, 3)), torch.full((2, 3), 448.0))


def test_keys_are_smoothed_by_their_mean_over_the_tokens_before_quantization() -> None:
    q, k, v = _qkv(offset=6.0)  # a channel offset every token shares: smoothing takes it out of K's range
    _, k8, _, _, k_scale, _ = flashinfer_fa3.quantize(q, k, v)
    smoothed = k.float() - k.mean(dim=2, keepdim=True, dtype=torch.float32)  # in float32, not K's dtype
    assert torch.allclose(_dequantized(k8, k_scale), smoothed, rtol=2.0 ** -4, atol=float(k_scale.max()) * 2.0 ** -9)
    assert float(k_scale.max()) < float(flashinfer_fa3.head_scales(k).min())  # a finer scale than K's own


def test_values_are_smoothed_by_the_mean_they_are_given_before_quantization() -> None:
    q, k, v = _qkv()
    v = v + 6.0  # an offset every token shares
    mean = flashinfer_fa3.value_mean(v)
    _, _, v8, _, _, v_scale = flashinfer_fa3.quantize(q, k, v, mean)
    smoothed = v.float() - v.mean(dim=2, keepdim=True, dtype=torch.float32)
    assert mean.shape == (2, 3, 1, 64) and mean.dtype == torch.float32
    assert torch.allclose(_dequantized(v8, v_scale), smoothed, rtol=2.0 ** -4, atol=float(v_scale.max()) * 2.0 ** -9)
    assert float(v_scale.max()) < float(flashinfer_fa3.head_scales(v).min())  # a finer scale than V's own


def test_an_all_zero_head_quantizes_to_zeros_with_a_finite_scale() -> None:
    q, k, v = _qkv()
    q[0, 1] = 0
    q8, *_, = flashinfer_fa3.quantize(q, k, v)
    scales = flashinfer_fa3.head_scales(q)
    assert scales[0, 1] > 0 and torch.isfinite(scales).all()
    assert torch.equal(q8[0, 1].float(), torch.zeros(40, 64))


E4M3_TRITON_INTERPRETED = """
import json
import torch
from hookkit.techniques.attention import e4m3_triton, flashinfer_fa3

g = torch.Generator().manual_seed(0)
def qkv(dtype, tokens, heads_last):
    # 300 tokens: a full block (256 tokens of heads of 64) and a partial one;
    # heads_last: diffusers' [B, N, H, D] transposed to [B, H, N, D]
    shape = (2, tokens, 3, 64) if heads_last else (2, 3, tokens, 64)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(3))
    k = k + 6.0 * torch.randn(64, generator=g).to(dtype)  # a channel offset every token shares
    v = v + 3.0 * torch.randn(64, generator=g).to(dtype)  # V's, which the mean takes out
    if heads_last:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q[0, 1] = 0  # a head of zeros
    return q, k, v

result = {}
for name, dtype, heads_last in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                                ("bf16 heads last", torch.bfloat16, True)):
    inputs = qkv(dtype, 300, heads_last)
    mean = flashinfer_fa3.value_mean(inputs[2])
    triton_out = e4m3_triton.quantize(*inputs, flashinfer_fa3.scale_of, mean)
    torch_out = flashinfer_fa3.quantize_torch(*inputs, mean)
    result[name] = [torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                    for a, b in zip(triton_out, torch_out)]
    result[name + " layout"] = triton_out[0].stride() == inputs[0].stride()
print(json.dumps(result))
"""


def test_the_triton_quantization_gives_the_torch_ops_bits_in_tritons_interpreter(
        interpreted: Callable[[str], Any]) -> None:
    result = interpreted(E4M3_TRITON_INTERPRETED)
    assert result == {"bf16": [True] * 6, "fp16": [True] * 6, "bf16 heads last": [True] * 6,
                      "bf16 layout": True, "fp16 layout": True, "bf16 heads last layout": True}


def test_quantize_runs_the_torch_ops_on_the_cpu_and_under_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as if on a GPU: the Triton path
    calls: list[str] = []
    import hookkit.techniques.attention.e4m3_triton as e4m3_triton

    monkeypatch.setattr(e4m3_triton, "quantize", lambda q, k, v, scale_of, mean=None: calls.append("triton")
                        or flashinfer_fa3.quantize_torch(q, k, v, mean))
    flashinfer_fa3.quantize(q, k, v)
    torch.compile(flashinfer_fa3.quantize, backend="eager", fullgraph=True)(q, k, v)
    assert calls == ["triton"]  # the eager call; the traced one runs the torch ops


# --- the calls to FlashInfer -------------------------------------------------------------------------------------


def test_one_fa3_call_per_batch_element_on_nhd_views_with_per_head_scales(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=2, heads=3, tokens=40, dim=64)
    flashinfer_fa3.attention(q, k, v)
    assert stand_in.calls == [{"shapes": ((40, 3, 64),) * 3, "dtype": torch.float8_e4m3fn,
                               "scales": ((3,),) * 3, "o_dtype": torch.bfloat16, "causal": False,
                               "sm_scale": 64 ** -0.5, "kv_layout": "NHD", "backend": "fa3"}] * 2


def test_the_output_is_sdpas_layout_and_matches_it_within_fp8_error(stand_in: StandIn) -> None:
    q, k, v = _qkv(offset=3.0)
    out = flashinfer_fa3.attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert out.stride() == (40 * 3 * 64, 64, 3 * 64, 1)  # a [B, H, N, D] view of [B, N, H, D]
    assert ((out.float() - ref).abs().mean() / ref.abs().mean()).item() < 0.05


def test_a_causal_call_and_an_explicit_scale_reach_the_kernel(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1)
    out = flashinfer_fa3.attention(q, k, v, scale=0.2, causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.2)
    assert (stand_in.calls[0]["causal"], stand_in.calls[0]["sm_scale"]) == (True, 0.2)
    assert ((out.float() - ref).abs().mean() / ref.abs().mean()).item() < 0.05


def test_the_bf16_kernel_gets_the_inputs_as_they_come(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1)
    out = flashinfer_fa3.attention(q, k, v, fp8=False)
    assert stand_in.calls == [{"shapes": ((40, 3, 64),) * 3, "dtype": torch.bfloat16, "scales": None,
                               "o_dtype": torch.bfloat16, "causal": False, "sm_scale": 64 ** -0.5,
                               "kv_layout": "NHD", "backend": "fa3"}]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, rtol=2.0 ** -8, atol=1e-6)  # float32 attention rounded once to bf16


def test_inputs_strided_along_the_head_dimension_reach_the_kernel_with_unit_stride(stand_in: StandIn) -> None:
    seen: list[int] = []
    record = stand_in.single_prefill_with_kv_cache

    def strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.extend(t.stride(-1) for t in (q, k, v))
        return record(q, k, v, **kwargs)

    stand_in.single_prefill_with_kv_cache = strides  # type: ignore[method-assign]
    q, k, v = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in _qkv(batch=1))  # head dim strided
    out = flashinfer_fa3.attention(q, k, v, fp8=False)
    assert seen == [1, 1, 1]
    assert torch.allclose(out.float(), F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                          rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.parametrize("kernel,fp8", [("flashinfer_fp8", True), ("flashinfer", False)])
def test_the_sdpa_call_runs_through_hookkits_op(stand_in: StandIn, kernel: str, fp8: bool) -> None:
    q, k, v = _qkv()
    out = run_kernel(kernel, F.scaled_dot_product_attention, (q, k, v), {})
    assert torch.equal(out, flashinfer_fa3.attention(q, k, v, fp8=fp8))
    assert len(stand_in.calls) == 4  # two batch elements, two calls


def _quantized_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
    return (*flashinfer_fa3.quantize(q, k, v), 0.125, False, torch.bfloat16)


@pytest.mark.parametrize("op,args", [("flashinfer_fp8_attention", _quantized_args),
                                     ("flashinfer_attention", lambda q, k, v: (q, k, v, 0.125, False))])
def test_the_ops_traced_output_has_the_layout_of_its_real_output(stand_in: StandIn, op: str, args: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = args(*_qkv())
    real = getattr(torch.ops.hookkit, op)(*values)
    with FakeTensorMode() as mode:
        fake = getattr(torch.ops.hookkit, op)(*(mode.from_tensor(a) if torch.is_tensor(a) else a for a in values))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


@pytest.mark.parametrize("kernel", ["flashinfer_fp8", "flashinfer"])
def test_under_torch_compile_the_call_traces_whole_and_gives_the_eager_result(stand_in: StandIn, kernel: str) -> None:
    q, k, v = _qkv()

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = run_kernel(kernel, F.scaled_dot_product_attention, (q, k, v), {})
        return out.transpose(1, 2).flatten(2, 3) * 2  # what a diffusers processor does next

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), block(q, k, v))


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_heads_flashinfer_has_no_kernel_for_run_zero_padded_to_the_next_size(stand_in: StandIn, fp8: bool) -> None:
    q, k, v = _qkv(batch=1, dim=32, offset=3.0)  # the trained models' heads of 32
    out = flashinfer_fa3.attention(q, k, v, fp8=fp8)
    assert [(c["shapes"], c["sm_scale"]) for c in stand_in.calls] == [(((40, 3, 64),) * 3, 32 ** -0.5)]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs().mean() / ref.abs().mean()).item() < (0.05 if fp8 else 2.0 ** -8)


def test_zero_padding_the_heads_changes_no_fp8_scale() -> None:
    q, k, v = _qkv(batch=1, dim=32, offset=3.0)
    padded = flashinfer_fa3.quantize(*(F.pad(t, (0, 32)) for t in (q, k, v)))
    unpadded = flashinfer_fa3.quantize(q, k, v)
    for scales, same in zip(padded[3:], unpadded[3:], strict=True):
        assert torch.equal(scales, same)
    for q8, same in zip(padded[:3], unpadded[:3], strict=True):
        assert torch.equal(q8[..., :32].float(), same.float()) and not q8[..., 32:].float().any()


@pytest.mark.parametrize("dim,size", [(8, 64), (32, 64), (64, 64), (72, 128), (96, 128), (128, 128), (160, 256),
                                      (256, 256), (257, None)])
def test_each_head_size_runs_at_the_smallest_kernel_size_that_holds_it(dim: int, size: int | None) -> None:
    assert flashinfer_fa3.padded_size(dim) == size


def test_padded_heads_trace_whole_under_torch_compile_and_give_the_eager_result(stand_in: StandIn) -> None:
    q, k, v = _qkv(dim=32)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = run_kernel("flashinfer", F.scaled_dot_product_attention, (q, k, v), {})
        return out.transpose(1, 2).flatten(2, 3) * 2

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), block(q, k, v))
    assert [c["shapes"][0] for c in stand_in.calls] == [(40, 3, 64)] * 4  # two batch elements, eager and compiled


# --- what the kernel takes, and refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,reason", [
    ({"attn_mask": torch.ones(1, 1, 1, flashinfer_fa3.FP8_MIN_KEYS, dtype=torch.bool)}, "attention mask"),
    ({"is_causal": True}, "not on CUDA"),  # causal taken: the next check speaks
    ({"dropout_p": 0.1}, "dropout"),
])
@pytest.mark.parametrize("kernel", ["flashinfer_fp8", "flashinfer"])
def test_masks_and_dropout_run_as_native_and_a_causal_call_is_taken(kwargs: dict[str, Any], reason: str,
                                                                    kernel: str) -> None:
    q, k, v = _qkv(batch=1, heads=1, tokens=flashinfer_fa3.FP8_MIN_KEYS, dim=128)
    assert unsupported(kernel, _sdpa_args((q, k, v), kwargs)) == reason


@pytest.mark.parametrize("keys,reason", [(flashinfer_fa3.FP8_MIN_KEYS - 1, "fewer than 8192 keys"),
                                         (flashinfer_fa3.FP8_MIN_KEYS, "not on CUDA")])  # taken: the next check speaks
def test_the_fp8_kernel_runs_calls_of_fewer_than_8192_keys_as_native(keys: int, reason: str) -> None:
    q, _, _ = _qkv(batch=1, heads=1, tokens=8, dim=128)
    k, v = _qkv(batch=1, heads=1, tokens=keys, dim=128)[1:]
    assert unsupported("flashinfer_fp8", _sdpa_args((q, k, v), {})) == reason


def test_the_bf16_kernel_takes_calls_of_any_length() -> None:
    q, k, v = _qkv(batch=1, heads=1, tokens=8, dim=128)
    assert unsupported("flashinfer", _sdpa_args((q, k, v), {})) == "not on CUDA"


@pytest.mark.parametrize("dim,ok", [(32, True), (64, True), (96, True), (256, True), (257, False), (512, False)])
def test_the_bf16_kernel_takes_heads_up_to_256(dim: int, ok: bool) -> None:
    assert head_sizes_ok("flashinfer", dim) is ok


@pytest.mark.parametrize("dim,ok", [(32, False), (64, False), (96, False), (128, True), (256, False)])
def test_the_fp8_kernel_takes_only_heads_of_128_where_a_gpu_showed_it_computes_its_arithmetic(dim: int,
                                                                                               ok: bool) -> None:
    assert head_sizes_ok("flashinfer_fp8", dim) is ok


def test_the_fp8_kernel_is_refused_at_enable_on_heads_of_32(stand_in: StandIn) -> None:
    pipe = zoo.tiny_pipeline("flux", attention_head_dim=32, axes_dims_rope=[8, 12, 12]).to(torch.bfloat16)
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(pipe, hookkit.Spec(attention=hookkit.Attention(low_precision="flashinfer_fp8")))
    assert str(err.value) == ("Attention.low_precision: 'flashinfer_fp8' expected heads of size 128 (the sizes a GPU "
                              "has shown it computes its own arithmetic at), got 32 at transformer_blocks.0.attn. "
                              "Choose another kernel, or keep the block at `kernel` (Attention.full_blocks).")


@pytest.mark.parametrize("version,ok", [("0.2.14.post1", True), ("0.2.14", True), ("0.7.4", True),
                                        ("0.2.9", False), ("0.2.13", False), ("1.0.0rc1", True), ("unknown", False)])
def test_flashinfer_versions_from_0_2_14_are_taken(version: str, ok: bool) -> None:
    assert flashinfer_fa3.version_ok(version) is ok


@pytest.mark.parametrize("capability,refusal", [
    ((9, 0), None),
    ((8, 9), "Attention.low_precision: 'flashinfer_fp8' expected a GPU of compute capability >= 9.0, got 8.9 (GPU). "
             "Choose kernel='native' or '_native_efficient'."),
    ((10, 0), "Attention.low_precision: 'flashinfer_fp8' expected a Hopper GPU (compute capability 9.x: its kernel "
              "is sm_90a code), got 10.0 (GPU). Choose 'hookkit_fp8' (compute capability 8.9 and newer) or "
              "'hookkit_int8'."),
])
def test_only_hopper_gpus_run_flashinfers_fp8_kernel(capability: tuple[int, int], refusal: str | None) -> None:
    assert capability_refusal("flashinfer_fp8", "low_precision", capability, "GPU") == refusal


def test_only_hopper_gpus_run_flashinfers_bf16_kernel() -> None:
    assert capability_refusal("flashinfer", "kernel", (9, 0), "H200") is None
    assert capability_refusal("flashinfer", "kernel", (10, 0), "B200") == (
        "Attention.kernel: 'flashinfer' expected a Hopper GPU (compute capability 9.x: its kernel is sm_90a code), got "
        "10.0 (B200). Choose '_native_cudnn'.")


@pytest.mark.skipif(FLASHINFER, reason="flashinfer is installed")
def test_flashinfer_fp8_without_the_package_is_refused() -> None:
    pipe = zoo.tiny_pipeline("flux").to(torch.bfloat16)
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(pipe, hookkit.Spec(attention=hookkit.Attention(low_precision="flashinfer_fp8")))
    assert str(err.value) == ("Attention.low_precision: 'flashinfer_fp8' needs the 'flashinfer' package, which is not "
                              "installed. `pip install flashinfer-python`, or choose another kernel.")


def test_a_flashinfer_older_than_the_fp8_api_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", StandIn(version="0.2.9"))
    pipe = zoo.tiny_pipeline("flux").to(torch.bfloat16)
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(pipe, hookkit.Spec(attention=hookkit.Attention(low_precision="flashinfer_fp8")))
    assert str(err.value) == ("Attention.low_precision: 'flashinfer_fp8' expected flashinfer-python >= 0.2.14 (its "
                              "FA3 backend with fp8 inputs and per-head scales), got 0.2.9. `pip install -U "
                              "flashinfer-python`, or choose another kernel.")


def test_heads_larger_than_flashinfers_largest_kernel_are_refused(stand_in: StandIn) -> None:
    pipe = zoo.tiny_pipeline("flux", attention_head_dim=320, axes_dims_rope=[64, 128, 128]).to(torch.bfloat16)
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(pipe, hookkit.Spec(attention=hookkit.Attention(kernel="flashinfer", low_precision=None)))
    assert str(err.value) == ("Attention.kernel: 'flashinfer' expected heads of size up to 256, got 320 at "
                              "transformer_blocks.0.attn. Choose another kernel, or keep the block at `kernel` "
                              "(Attention.full_blocks).")


def test_enable_has_flashinfer_build_the_kernel_for_each_head_size(stand_in: StandIn) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    check_hopper_kernel("flashinfer_fp8", "low_precision", [128], torch.bfloat16, torch.device("cpu"))
    check_hopper_kernel("flashinfer", "kernel", [128], torch.float16, torch.device("cpu"))
    assert [(c["shapes"][0], c["dtype"], c["o_dtype"]) for c in stand_in.calls] == [
        ((120, 4, 128), torch.float8_e4m3fn, torch.bfloat16), ((120, 4, 128), torch.float16, torch.float16)]


def test_enable_checks_each_head_size_through_the_padded_kernel_it_runs_at(stand_in: StandIn) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    check_hopper_kernel("flashinfer", "kernel", [32, 64, 96], torch.bfloat16, torch.device("cpu"))
    assert [(c["shapes"][0], c["sm_scale"]) for c in stand_in.calls] == [
        ((120, 4, 64), 32 ** -0.5), ((120, 4, 64), 64 ** -0.5), ((120, 4, 128), 96 ** -0.5)]


def test_enables_check_finds_an_fp8_kernel_computing_its_arithmetic_erring_as_its_arithmetic_does(
        stand_in: StandIn) -> None:
    error = flashinfer_fa3.check(128, torch.bfloat16, torch.device("cpu"), fp8=True)
    assert error == pytest.approx(1.0, abs=0.02)  # the stand-in computes `reference`; only its bf16 output differs


def test_enables_check_accepts_an_fp8_kernel_rounding_p_against_a_running_maximum(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # FlashInfer's kernel over more keys than a tile: a rounding of P other than `reference`'s, as large as it
    module = StandIn()
    monkeypatch.setattr(module, "single_prefill_with_kv_cache", rounding_against_a_running_maximum(tile=8))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    q, k, v = _qkv(batch=1, heads=1, tokens=120, dim=128)
    apart = flashinfer_fa3.relative_error(flashinfer_fa3.attention(q, k, v).float(),
                                          flashinfer_fa3.reference_attention(q, k, v))
    error = flashinfer_fa3.check(128, torch.bfloat16, torch.device("cpu"), fp8=True)
    assert apart > 0.005  # computes something other than `reference` ...
    assert error == pytest.approx(1.0, abs=0.01)  # ... that errs as `reference` does


def test_the_fp8_kernels_output_gets_the_mean_taken_out_of_the_values_back(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1, tokens=120, dim=128)
    v = v + 4.0  # an offset every token shares, far above the spread
    out = flashinfer_fa3.attention(q, k, v).float()
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.allclose(out, flashinfer_fa3.reference_attention(q, k, v), rtol=2.0 ** -8, atol=2.0 ** -6)
    assert flashinfer_fa3.relative_error(out, exact) < 0.005  # the offset passes through exactly


def test_smoothing_the_values_makes_hoppers_fp8_accumulation_err_as_the_kernels_arithmetic(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # enable's check's head 2 (channel offsets in Q, K and V) at 2,048 keys, 16 queries; P·V accumulated as Hopper's
    # fp8 tensor cores do: the values' shared offset grows the sum, whose low bits each block of keys then loses (at
    # the check's 8,192 keys this model errs 21x its arithmetic, FlashInfer's kernel on an H100 14.5x)
    module = StandIn()
    monkeypatch.setattr(module, "single_prefill_with_kv_cache", accumulating_p_v_in_limited_precision())
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    q, k, v = (t[:, 2:3] for t in flashinfer_fa3.check_inputs(128, 2048, torch.bfloat16, torch.device("cpu")))
    q = q[:, :, :16]
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    ratios = {}
    for smooth in (False, True):
        out = flashinfer_fa3.attention(q, k, v, smooth_value=smooth).float()
        mirror = flashinfer_fa3.reference_attention(q, k, v, smooth_value=smooth)
        ratios[smooth] = flashinfer_fa3.relative_error(out, exact) / flashinfer_fa3.relative_error(mirror, exact)
    assert ratios[False] == pytest.approx(3.82, abs=0.01)  # V as it comes: over twice the check's bound of 1.5x
    assert ratios[True] == pytest.approx(1.04, abs=0.01)  # V smoothed: as its arithmetic


def test_enables_check_finds_a_bf16_kernel_within_its_bound_of_float32_attention(stand_in: StandIn) -> None:
    error = flashinfer_fa3.check(128, torch.bfloat16, torch.device("cpu"), fp8=False)
    assert 0 < error < flashinfer_fa3.CHECK_BOUND[False] / 4


def test_enables_check_reports_its_worst_head(monkeypatch: pytest.MonkeyPatch) -> None:
    module = StandIn()
    record = module.single_prefill_with_kv_cache

    def last_head_off_by_a_tenth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = record(q, k, v, **kwargs)
        out[:, -1] *= 0.8  # [N, H, D]: the last of the check's four heads (V's mean is added back after this)
        return out

    monkeypatch.setattr(module, "single_prefill_with_kv_cache", last_head_off_by_a_tenth)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    error = flashinfer_fa3.check(128, torch.bfloat16, torch.device("cpu"), fp8=True)
    # the last head's: 2.21x its arithmetic's error, over the bound; the mean of the four heads' (1.31x) is under it
    assert error == pytest.approx(2.21, abs=0.01)
    assert error > flashinfer_fa3.CHECK_BOUND[True]


def test_the_fp8_reference_is_fp32_attention_of_the_dequantized_inputs_with_p_rounded_to_e4m3() -> None:
    q, k, v = _qkv(batch=1, tokens=100, dim=128, offset=2.0)
    codes = flashinfer_fa3.quantize(q, k, v)
    out = flashinfer_fa3.reference(*codes, 128 ** -0.5)
    exact = F.scaled_dot_product_attention(*(_dequantized(c, s) for c, s in zip(codes[:3], codes[3:])))
    error = ((out - exact).abs().mean() / exact.abs().mean()).item()
    assert 0.002 < error < 0.03  # only P's rounding to e4m3 (3 mantissa bits) separates them


def test_an_fp8_kernel_off_by_a_tenth_is_refused_at_enable(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    module = StandIn()
    record = module.single_prefill_with_kv_cache
    monkeypatch.setattr(module, "single_prefill_with_kv_cache",
                        lambda q, k, v, **kwargs: record(q, k, v, **kwargs) * 0.9)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    with pytest.raises(UnsupportedError, match=r"heads of 128 \(torch\.bfloat16\) to err against float32 attention "
                                               r"at most 1\.5x what its own arithmetic \(flashinfer_fa3\.reference\) "
                                               r"errs on each head of enable's check \(seeded random inputs, 120 "
                                               r"tokens\), got 1\.82x: "):
        check_hopper_kernel("flashinfer_fp8", "low_precision", [128], torch.bfloat16, torch.device("cpu"))


def test_a_flashinfer_whose_fp8_scales_mean_something_else_is_refused_at_enable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    module = StandIn(version="9.9.9")
    record = module.single_prefill_with_kv_cache

    def divides_by_the_scales(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for name in ("scale_q", "scale_k", "scale_v"):  # a release that took quantization scales, not dequantization
            kwargs[name] = 1 / kwargs[name]
        return record(q, k, v, **kwargs)

    monkeypatch.setattr(module, "single_prefill_with_kv_cache", divides_by_the_scales)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    with pytest.raises(UnsupportedError) as err:
        check_hopper_kernel("flashinfer_fp8", "low_precision", [128], torch.bfloat16, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("Attention.low_precision: 'flashinfer_fp8' expected FlashInfer's kernel for heads of 128 "
                              "(torch.bfloat16) to err against float32 attention at most 1.5x what its own arithmetic "
                              "(flashinfer_fa3.reference) errs on each head of enable's check (seeded random inputs, "
                              "120 tokens), got ")
    assert message.endswith(": FlashInfer 9.9.9 computes something other than what hookkit's call means. Choose "
                            "'hookkit_fp8', or install a FlashInfer release from 0.2.14 to 0.7.4.")


def test_an_fp8_kernel_applying_the_first_heads_scales_to_every_head_is_refused_at_enable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    module = StandIn()
    monkeypatch.setattr(module, "single_prefill_with_kv_cache",
                        applying_first_heads_scales(module.single_prefill_with_kv_cache))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    with pytest.raises(UnsupportedError, match=r"errs on each head of enable's check \(seeded random inputs, 120 "
                                               r"tokens\), got 13\.4x: "
                                               r"FlashInfer 0\.2\.14\.post1 computes"):
        check_hopper_kernel("flashinfer_fp8", "low_precision", [128], torch.bfloat16, torch.device("cpu"))


def test_a_kernel_that_returns_nan_is_refused_at_enable(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    module = StandIn()
    record = module.single_prefill_with_kv_cache
    monkeypatch.setattr(module, "single_prefill_with_kv_cache",
                        lambda q, k, v, **kwargs: record(q, k, v, **kwargs) * float("nan"))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    with pytest.raises(UnsupportedError, match=r"to match float32 attention within a mean relative error of 0\.02 "
                                               r"on each head of enable's "
                                               r"check \(seeded random inputs, 120 tokens\), got nan: "
                                               r"FlashInfer 0\.2\.14\.post1 computes"):
        check_hopper_kernel("flashinfer", "kernel", [64], torch.bfloat16, torch.device("cpu"))


def test_a_kernel_flashinfer_cannot_build_is_refused_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.techniques.attention.hooks import check_hopper_kernel

    def no_compiler(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("Ninja build failed: nvcc: not found\nmore lines")

    module = StandIn()
    monkeypatch.setattr(module, "single_prefill_with_kv_cache", no_compiler)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    with pytest.raises(UnsupportedError) as err:
        check_hopper_kernel("flashinfer_fp8", "low_precision", [128], torch.bfloat16, torch.device("cpu"))
    assert str(err.value) == ("Attention.low_precision: 'flashinfer_fp8' expected FlashInfer to build and run its "
                              "kernel for heads of 128 (torch.bfloat16), got RuntimeError: Ninja build failed: nvcc: "
                              "not found. FlashInfer compiles the kernel with nvcc at first use: put CUDA's compiler "
                              "on PATH (or set CUDA_HOME), or choose 'hookkit_fp8'.")


# --- GPU: the kernel -----------------------------------------------------------------------------------------------

needs_hopper_and_flashinfer = pytest.mark.skipif(
    not (FLASHINFER and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs flashinfer and a Hopper GPU")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with fp8 (SM 8.9+)")
def test_gpu_triton_quantization_gives_the_torch_ops_bits_at_wan_shape_in_diffusers_layout() -> None:
    from hookkit.techniques.attention import e4m3_triton

    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 8190, 40, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    k = k + 2.0 * torch.randn(128, device="cuda", generator=g, dtype=torch.bfloat16)
    triton_out = e4m3_triton.quantize(q, k, v, flashinfer_fa3.scale_of)
    for a, b in zip(triton_out, flashinfer_fa3.quantize_torch(q, k, v), strict=True):
        if a.dtype == torch.float8_e4m3fn:  # compared as bytes: signed zeros and all
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_hopper_and_flashinfer
def test_gpu_flashinfer_fp8_matches_attention_of_its_quantized_inputs_and_bf16_sdpa() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8192, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    k = k + 2.0  # a shared channel offset, as real keys have
    q8, k8, v8, qs, ks, vs = flashinfer_fa3.quantize(q, k, v)
    exact = F.scaled_dot_product_attention(_dequantized(q8, qs), _dequantized(k8, ks), _dequantized(v8, vs))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out = flashinfer_fa3.attention(q, k, v).float()
    assert ((out - exact).abs().mean() / exact.abs().mean()).item() < 0.05  # P in e4m3, fp32 accumulation
    assert ((out - ref).abs().mean() / ref.abs().mean()).item() < 0.1


@pytest.mark.gpu
@needs_hopper_and_flashinfer
def test_gpu_enables_check_finds_the_fp8_kernel_computing_its_own_arithmetic_on_heads_of_128() -> None:
    # at 8,192 keys, where the kernel rounds P against a running maximum: 2.5-7.5 % from `reference` on an H100; with V
    # as it comes (before V's smoothing) a head shaped like real activations erred 14.5x its arithmetic there
    assert flashinfer_fa3.CHECK_TOKENS[True] == flashinfer_fa3.FP8_MIN_KEYS
    error = flashinfer_fa3.check(128, torch.bfloat16, torch.device("cuda"), fp8=True)
    assert error < flashinfer_fa3.CHECK_BOUND[True]


@pytest.mark.gpu
@needs_hopper_and_flashinfer
def test_gpu_flashinfer_bf16_is_as_close_to_float32_attention_as_sdpa() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8192, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    sdpa = (F.scaled_dot_product_attention(q, k, v).float() - ref).abs().mean()
    out = flashinfer_fa3.attention(q, k, v, fp8=False).float()
    assert (out - ref).abs().mean().item() < 2 * sdpa.item()


@pytest.mark.gpu
@needs_hopper_and_flashinfer
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_gpu_heads_of_32_run_padded_to_64_as_close_to_sdpa_as_heads_of_64(fp8: bool) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 4096, 32, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    out = flashinfer_fa3.attention(q, k, v, fp8=fp8).float()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.shape == (1, 4, 4096, 32)
    assert ((out - ref).abs().mean() / ref.abs().mean()).item() < (0.1 if fp8 else 0.01)


def _bf16_flux_head128() -> Any:
    """The tiny Flux with heads of 128, the size of Wan's and of the kernel tests: FlashInfer builds one module per
    head size (minutes), and these tests reuse the kernel tests' modules."""
    return zoo.tiny_pipeline("flux", attention_head_dim=128, axes_dims_rope=[32, 48, 48]).to("cuda", torch.bfloat16)


#: images of 368² give the tiny Flux 8,464 image tokens and 8 text tokens: more keys than `FP8_MIN_KEYS`, so that
#: FlashInfer's fp8 kernel takes the calls
SIZE_FOR_FP8 = 368


@pytest.mark.gpu
@needs_hopper_and_flashinfer
@pytest.mark.parametrize("compile_spec", [hookkit.Compile(), hookkit.Compile(cuda_graphs="transformer")],
                         ids=["regional-compile", "whole-transformer-graphs"])
@pytest.mark.parametrize("kernel", ["flashinfer_fp8", "flashinfer"])
def test_gpu_flashinfer_under_compile_matches_eager_attention(compile_spec: hookkit.Compile, kernel: str) -> None:
    middle = hookkit.Attention(low_precision=kernel, full_first=1, full_last=1)
    eager = _bf16_flux_head128()
    try:
        handle = hookkit.enable(eager, hookkit.Spec(attention=middle))
    except UnsupportedError as exc:
        # what this test checks (the kernel under compile as eager runs it) needs a kernel enable takes; whether it
        # takes FlashInfer's fp8 kernel is the check's test, above
        if "expected FlashInfer's kernel" not in str(exc):
            raise
        pytest.skip(f"enable refuses {kernel} on this machine: {exc}")
    fast = _bf16_flux_head128()
    hookkit.enable(fast, hookkit.Spec(attention=middle, compile=compile_spec))
    expected = call_flux_bf16(eager, size=SIZE_FOR_FP8)
    assert handle.summary().features["attention"].data["phases"]["middle"]["attention_calls"] == {kernel: 10}
    for _ in range(2):
        assert relative_error(call_flux_bf16(fast, size=SIZE_FOR_FP8), expected) < 1e-2


def test_check_inputs_put_the_offsets_only_in_the_tensors_named_keeping_the_same_draws() -> None:
    q, k, v = flashinfer_fa3.check_inputs(32, 20, torch.float32, torch.device("cpu"))
    q_only = flashinfer_fa3.check_inputs(32, 20, torch.float32, torch.device("cpu"), offset_in="q")
    assert torch.equal(q_only[0], q)
    for full, plain in ((k, q_only[1]), (v, q_only[2])):
        assert torch.equal(full[:, :2], plain[:, :2])  # heads 0 and 1 carry no offset either way
        assert not torch.equal(full[:, 2:], plain[:, 2:])
        spread = (full[:, 2:] - plain[:, 2:]).std(dim=2)  # heads 2 and 3: one offset per channel, over all tokens
        assert torch.allclose(spread, torch.zeros_like(spread), atol=1e-5)
