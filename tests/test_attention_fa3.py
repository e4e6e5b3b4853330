"""FlashAttention-3's own Hopper e4m3 kernel as `Attention(low_precision="fa3_fp8")`: the call hookkit makes to FA3's
`flash_attn_interface.flash_attn_func` on the quantization FlashInfer's port gets, the op under torch.compile, the
check at enable, and the refusals.

On the CPU a stand-in `flash_attn_interface` module (`fa3_stand_in.StandIn`) computes FA3's fp8 semantics and records
each call, so the tests check hookkit's side of the contract: layouts, descales, one call per batch, the output's
layout. The kernel itself needs FA3 built from flash-attention's hopper/ folder and a Hopper GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hookkit
from fa3_stand_in import StandIn
from hookkit.errors import SpecError, UnsupportedError
from hookkit.techniques.attention import fa3_hopper, flashinfer_fa3
from hookkit.techniques.attention.hooks import (_sdpa_args, capability_refusal, check_hopper_kernel, head_sizes_ok,
                                                run_kernel, unsupported)
from hookkit.techniques.attention.spec import LOW_KERNELS
from hookkit.tools import zoo
from test_attention_flashinfer import _qkv, short_fp8_check  # noqa: F401 - the CPU's short enable check (autouse)

CPU = torch.device("cpu")
BUILD = ("git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
         "python setup.py install")


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    module = StandIn()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    return module


def _fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs: Any) -> torch.Tensor:
    """The SDPA call as hookkit's mode answers it with "fa3_fp8"."""
    return run_kernel("fa3_fp8", F.scaled_dot_product_attention, (q, k, v), sdpa_kwargs)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().mean() / ref.abs().mean()).item()


# --- the call to FA3 -----------------------------------------------------------------------------------------------


def test_one_fa3_call_for_the_whole_batch_on_bnhd_views_with_bh_descales(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=2, heads=3, tokens=40, dim=128)
    _fa3(q, k, v)
    assert stand_in.calls == [{"shapes": ((2, 40, 3, 128),) * 3, "dtype": torch.float8_e4m3fn,
                               "descales": ((2, 3),) * 3, "descale_dtypes": (torch.float32,) * 3,
                               "last_strides": (1, 1, 1), "softmax_scale": 128 ** -0.5, "causal": False}]


def test_fa3_gets_the_codes_and_scales_flashinfers_port_gets(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1, heads=2, tokens=40, dim=128)
    codes = flashinfer_fa3.quantize(q, k, v, flashinfer_fa3.value_mean(v))
    seen: dict[str, torch.Tensor] = {}
    record = stand_in.flash_attn_func

    def keep(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.update(q=q8, k=k8, v=v8, **{n: kwargs[n] for n in ("q_descale", "k_descale", "v_descale")})
        return record(q8, k8, v8, **kwargs)

    stand_in.flash_attn_func = keep  # type: ignore[method-assign]
    _fa3(q, k, v)
    for name, expected in zip(("q", "k", "v", "q_descale", "k_descale", "v_descale"), codes, strict=True):
        got = seen[name].transpose(1, 2) if name in "qkv" else seen[name]
        assert torch.equal(got.float(), expected.float()), name


def test_the_output_is_sdpas_layout_and_matches_it_within_fp8_error(stand_in: StandIn) -> None:
    q, k, v = _qkv(tokens=40, dim=128, offset=3.0)
    out = _fa3(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert out.stride() == (40 * 3 * 128, 128, 3 * 128, 1)  # a [B, H, N, D] view of [B, N, H, D]
    assert _error(out, ref) < 0.05


def test_an_fp16_call_gets_an_fp16_output_in_the_same_layout(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1, tokens=40, dim=128, dtype=torch.float16)
    out = _fa3(q, k, v)
    assert (out.dtype, out.stride()) == (torch.float16, (40 * 3 * 128, 128, 3 * 128, 1))


def test_the_mean_taken_out_of_the_values_is_added_back_to_the_output(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1, tokens=120, dim=128)
    v = v + 4.0  # an offset every token shares, far above the spread
    out = _fa3(q, k, v).float()
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.allclose(out, flashinfer_fa3.reference_attention(q, k, v), rtol=2.0 ** -8, atol=2.0 ** -6)
    assert flashinfer_fa3.relative_error(out, exact) < 0.005  # the offset passes through exactly


def test_a_causal_call_and_an_explicit_scale_reach_fa3(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1, tokens=40, dim=128)
    out = _fa3(q, k, v, is_causal=True, scale=0.2)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.2)
    assert (stand_in.calls[0]["causal"], stand_in.calls[0]["softmax_scale"]) == (True, 0.2)
    assert _error(out, ref) < 0.05


def test_an_fa3_returning_its_softmax_lse_too_gives_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(batch=1, tokens=40, dim=128)
    outs = []
    for returns_lse in (False, True):
        monkeypatch.setitem(sys.modules, "flash_attn_interface", StandIn(returns_lse=returns_lse))
        outs.append(_fa3(q, k, v))
    assert torch.equal(outs[1], outs[0])


def test_codes_strided_along_the_head_dimension_reach_fa3_with_unit_stride(stand_in: StandIn) -> None:
    q, k, v = _qkv(batch=1, tokens=40, dim=128)
    q8, k8, v8, *scales = flashinfer_fa3.quantize(q, k, v)
    strided = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q8, k8, v8)]  # head dim strided
    out = fa3_hopper.run_fp8(*strided, *scales, 0.125, False, torch.bfloat16)
    assert [c["last_strides"] for c in stand_in.calls] == [(1, 1, 1)]
    assert torch.equal(out, fa3_hopper.run_fp8(q8, k8, v8, *scales, 0.125, False, torch.bfloat16))


def test_the_ops_traced_output_has_the_layout_of_its_real_output(stand_in: StandIn) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = (*flashinfer_fa3.quantize(*_qkv(dim=128)), 0.125, False, torch.bfloat16)
    real = torch.ops.hookkit.fa3_fp8_attention(*values)
    with FakeTensorMode() as mode:
        fake = torch.ops.hookkit.fa3_fp8_attention(*(mode.from_tensor(a) if torch.is_tensor(a) else a
                                                     for a in values))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_under_torch_compile_the_call_traces_whole_and_gives_the_eager_result(stand_in: StandIn) -> None:
    q, k, v = _qkv(dim=128)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _fa3(q, k, v).transpose(1, 2).flatten(2, 3) * 2  # what a diffusers processor does next

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), block(q, k, v))
    assert len(stand_in.calls) == 2  # one call for the batch, eager and compiled


# --- what the kernel takes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("keys,reason", [(flashinfer_fa3.FP8_MIN_KEYS - 1, "fewer than 8192 keys"),
                                         (flashinfer_fa3.FP8_MIN_KEYS, "not on CUDA")])  # taken: the next check speaks
def test_calls_of_fewer_than_8192_keys_run_as_native(keys: int, reason: str) -> None:
    q, _, _ = _qkv(batch=1, heads=1, tokens=8, dim=128)
    k, v = _qkv(batch=1, heads=1, tokens=keys, dim=128)[1:]
    assert unsupported("fa3_fp8", _sdpa_args((q, k, v), {})) == reason


@pytest.mark.parametrize("kwargs,reason", [
    ({"attn_mask": torch.ones(1, 1, 1, flashinfer_fa3.FP8_MIN_KEYS, dtype=torch.bool)}, "attention mask"),
    ({"attn_mask": torch.zeros(1, 1, 1, flashinfer_fa3.FP8_MIN_KEYS)}, "attention mask"),
    ({"is_causal": True}, "not on CUDA"),  # causal taken: the next check speaks
])
def test_masks_run_as_native_and_a_causal_call_is_taken(kwargs: dict[str, Any], reason: str) -> None:
    q, k, v = _qkv(batch=1, heads=1, tokens=flashinfer_fa3.FP8_MIN_KEYS, dim=128)
    assert unsupported("fa3_fp8", _sdpa_args((q, k, v), kwargs)) == reason


def test_calls_with_heads_other_than_128_run_as_native() -> None:
    q, k, v = _qkv(batch=1, heads=1, tokens=flashinfer_fa3.FP8_MIN_KEYS, dim=64)
    assert unsupported("fa3_fp8", _sdpa_args((q, k, v), {})) == "head size 64"


@pytest.mark.parametrize("dim,ok", [(32, False), (64, False), (96, False), (128, True), (256, False)])
def test_the_kernel_takes_only_heads_of_128(dim: int, ok: bool) -> None:
    assert head_sizes_ok("fa3_fp8", dim) is ok


# --- the spec and refusals -----------------------------------------------------------------------------------------


def test_the_spec_takes_fa3_fp8_as_its_low_precision_kernel() -> None:
    assert "fa3_fp8" in LOW_KERNELS
    assert hookkit.Attention(low_precision="fa3_fp8").kernels() == ("native", "fa3_fp8")


def test_fa3_fp8_as_the_full_precision_kernel_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"^Attention\.kernel: expected one of \('native',"):
        hookkit.Attention(kernel="fa3_fp8")


def test_fa3_fp8_without_flash_attn_interface_is_refused_with_the_build_instructions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # importlib finds no such module
    pipe = zoo.tiny_pipeline("flux").to(torch.bfloat16)
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(pipe, hookkit.Spec(attention=hookkit.Attention(low_precision="fa3_fp8")))
    assert str(err.value) == ("Attention.low_precision: 'fa3_fp8' needs the 'flash_attn_interface' package, which is "
                              "not installed. FA3 has no PyPI package: build flash-attention's hopper/ folder "
                              f"(`{BUILD}`), or choose another kernel.")


def test_fa3_fp8_is_refused_at_enable_on_heads_of_32(stand_in: StandIn) -> None:
    pipe = zoo.tiny_pipeline("flux", attention_head_dim=32, axes_dims_rope=[8, 12, 12]).to(torch.bfloat16)
    with pytest.raises(UnsupportedError) as err:
        hookkit.enable(pipe, hookkit.Spec(attention=hookkit.Attention(low_precision="fa3_fp8")))
    assert str(err.value) == ("Attention.low_precision: 'fa3_fp8' expected heads of size 128 (the sizes its kernel is "
                              "built and measured at), got 32 at transformer_blocks.0.attn. Choose another kernel, or "
                              "keep the block at `kernel` (Attention.full_blocks).")


@pytest.mark.parametrize("capability,refusal", [
    ((9, 0), None),
    ((8, 9), "Attention.low_precision: 'fa3_fp8' expected a GPU of compute capability >= 9.0, got 8.9 (GPU). "
             "Choose kernel='native' or '_native_efficient'."),
    ((10, 0), "Attention.low_precision: 'fa3_fp8' expected a Hopper GPU (compute capability 9.x: its kernel is "
              "sm_90a code), got 10.0 (GPU). Choose 'hookkit_fp8' (compute capability 8.9 and newer) or "
              "'hookkit_int8'."),
])
def test_only_hopper_gpus_run_fa3s_fp8_kernel(capability: tuple[int, int], refusal: str | None) -> None:
    assert capability_refusal("fa3_fp8", "low_precision", capability, "GPU") == refusal


# --- enable's check ------------------------------------------------------------------------------------------------


def test_enables_check_runs_fa3s_kernel_on_the_checks_inputs(stand_in: StandIn) -> None:
    check_hopper_kernel("fa3_fp8", "low_precision", [128], torch.bfloat16, CPU)
    assert [(c["shapes"][0], c["dtype"], c["descales"]) for c in stand_in.calls] == [
        ((1, 120, 4, 128), torch.float8_e4m3fn, ((1, 4),) * 3)]


def test_enables_check_finds_fa3s_kernel_erring_as_its_arithmetic_does(stand_in: StandIn) -> None:
    error = flashinfer_fa3.check(128, torch.bfloat16, CPU, fp8=True,
                                 kernels=(flashinfer_fa3.run_half, fa3_hopper.run_fp8))
    assert error == pytest.approx(1.0, abs=0.02)  # the stand-in computes `reference`; only its bf16 output differs


def test_an_fa3_kernel_off_by_a_tenth_is_refused_at_enable(stand_in: StandIn) -> None:
    record = stand_in.flash_attn_func
    stand_in.flash_attn_func = lambda q, k, v, **kwargs: record(q, k, v, **kwargs) * 0.9  # type: ignore[method-assign]
    with pytest.raises(UnsupportedError) as err:
        check_hopper_kernel("fa3_fp8", "low_precision", [128], torch.bfloat16, CPU)
    assert str(err.value) == (
        "Attention.low_precision: 'fa3_fp8' expected FA3's kernel for heads of 128 (torch.bfloat16) to err against "
        "float32 attention at most 1.5x what its own arithmetic (flashinfer_fa3.reference) errs on each head of "
        "enable's check (seeded random inputs, 120 tokens), got 1.82x: this FA3 build (flash_attn_interface) computes "
        "something other than what hookkit's call means. Choose 'flashinfer_fp8' (FlashInfer's port of the kernel) or "
        f"'hookkit_fp8', or rebuild FA3 from flash-attention's hopper/ folder (`{BUILD}`).")


def test_an_fa3_kernel_that_returns_nan_is_refused_at_enable(stand_in: StandIn) -> None:
    record = stand_in.flash_attn_func
    stand_in.flash_attn_func = (  # type: ignore[method-assign]
        lambda q, k, v, **kwargs: record(q, k, v, **kwargs) * float("nan"))
    with pytest.raises(UnsupportedError, match=r"on each head of enable's check \(seeded random inputs, 120 tokens\), "
                                               r"got nanx: this FA3 build \(flash_attn_interface\) computes"):
        check_hopper_kernel("fa3_fp8", "low_precision", [128], torch.bfloat16, CPU)


def test_an_fa3_without_fp8_descales_is_refused_at_enable_saying_so(stand_in: StandIn) -> None:
    record = stand_in.flash_attn_func

    def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                        causal: bool = False) -> torch.Tensor:  # an FA3 from before its fp8 descales
        return record(q, k, v, softmax_scale=softmax_scale, causal=causal)

    stand_in.flash_attn_func = flash_attn_func  # type: ignore[method-assign]
    with pytest.raises(UnsupportedError) as err:
        check_hopper_kernel("fa3_fp8", "low_precision", [128], torch.bfloat16, CPU)
    assert str(err.value) == (
        "Attention.low_precision: 'fa3_fp8' expected FA3's flash_attn_interface to run its e4m3 kernel for heads of "
        "128 (torch.bfloat16), got TypeError: test_an_fa3_without_fp8_descales_is_refused_at_enable_saying_so.<locals>"
        ".flash_attn_func() got an unexpected keyword argument 'q_descale' (a TypeError here: an FA3 build whose "
        "flash_attn_func takes no q_descale, k_descale and v_descale, older than its fp8 kernel's per-head "
        "descales). Choose 'flashinfer_fp8' (FlashInfer's port of the kernel) or 'hookkit_fp8', or rebuild FA3 from "
        f"flash-attention's hopper/ folder (`{BUILD}`).")


# --- on a Hopper GPU with FA3 built --------------------------------------------------------------------------------

needs_hopper_and_fa3 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
    or importlib.util.find_spec(fa3_hopper.MODULE) is None,
    reason="needs a Hopper GPU and FA3's flash_attn_interface (benchmarks/fa3_site.py builds it)")


@pytest.mark.gpu
@needs_hopper_and_fa3
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_enables_check_finds_fa3s_kernel_computing_its_own_arithmetic(dtype: torch.dtype) -> None:
    # one H100: 1.09x its arithmetic's error in bf16, 1.00x in fp16 (8,192 keys)
    error = flashinfer_fa3.check(128, dtype, torch.device("cuda"), fp8=True,
                                 kernels=(flashinfer_fa3.run_half, fa3_hopper.run_fp8))
    assert error < flashinfer_fa3.CHECK_BOUND[True]


@pytest.mark.gpu
@needs_hopper_and_fa3
def test_gpu_a_batch_of_two_errs_as_the_kernels_arithmetic_against_float32_attention() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9000, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    out = _fa3(q, k, v).float()
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    mirror = flashinfer_fa3.reference_attention(q, k, v)
    # one H100: 5.38 % against its arithmetic's 5.41 %
    assert flashinfer_fa3.error_ratio(out, mirror, exact) < 1.1
