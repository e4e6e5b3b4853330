"""Every Triton kernel of hookkit, in every variant it is launched with, builds Triton IR for a Hopper GPU — on the CPU.

Why: Triton's CPU interpreter (how the other tests check the kernels' arithmetic) runs each `@triton.jit` function as
Python and never types it, so code the GPU compiler refuses passes there (a `return` after a constexpr `if` that
returned a differently typed value did). Triton's frontend (`ASTSource.make_ir`, the first stage of every GPU compile)
runs without a GPU: what it refuses here, a GPU would refuse at the first call.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402

if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
    pytest.skip("TRITON_INTERPRET is set: the kernels are interpreted functions, not compiled ones",
                allow_module_level=True)

from hookkit.techniques.attention import e4m3_triton, fp8_triton, int8_triton, mask_tiles  # noqa: E402
from hookkit.techniques.compile import fp8_rows_triton, norm_rope_triton  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def triton_ir(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4) -> str:
    """The Triton IR of `kernel` for an H100/H200 (sm_90): `types` for the runtime arguments (Triton's signature
    strings: "*bf16", "i32", "fp32", "tensordesc<i8[128, 128]>"), `constexprs` for the rest. Raises Triton's
    `CompilationError` where a GPU compile would."""
    from triton._C.libtriton import ir

    names = list(kernel.arg_names)
    missing = set(names) - set(types) - set(constexprs)
    if missing:
        raise ValueError(f"no type or value for {sorted(missing)}")
    signature = {n: types.get(n, "constexpr") for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    backend = make_backend(HOPPER)
    options = backend.parse_options({"num_warps": num_warps})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    return str(source.make_ir(HOPPER, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                              context))


def _typed(names: str, kinds: list[str]) -> dict[str, str]:
    return dict(zip(names.split(), kinds, strict=True))


FP8_ATTENTION_ARGS = ("q_src k_src v_src qs_ptr ks_ptr vs_ptr vm_ptr out_ptr heads q_tokens k_tokens q_blocks k_blocks "
                      "stride_ob stride_oh stride_os mask_ptr order_ptr counts_ptr stride_mb stride_mh stride_mq "
                      "stride_mk stride_cb stride_ch stride_cq key_counts_ptr")
#: the mask arguments as an unmasked launch passes them (a float32 tensor for each pointer, zeros for the strides)
UNMASKED = ["*fp32"] * 3 + ["i32"] * 7
#: the fp8 kernel's key counts as a launch without them passes them (a float32 tensor)
NO_KEY_COUNTS = ["*fp32"]


@pytest.mark.parametrize("loop", [0, 1, 2, 3])
@pytest.mark.parametrize("qk_int8", [True, False])
def test_fp8_attention_kernel_builds_for_hopper_in_every_loop_and_qk_precision(loop: int, qk_int8: bool) -> None:
    codes = "*i8" if qk_int8 else "*fp8e4nv"
    types = _typed(FP8_ATTENTION_ARGS, [codes, codes, "*fp8e4nv"] + ["*fp32"] * 4 + ["*bf16"] + ["i32"] * 8
                   + UNMASKED + NO_KEY_COUNTS)
    text = triton_ir(fp8_triton._fp8_attention_kernel, types,
                     dict(D=128, BLOCK_M=128, BLOCK_N=128, QK_INT8=qk_int8, EXP_F16=False, LOOP=loop, TMA=False,
                          INTERPRET=False, MASKED=False, KEY_COUNTS=False))
    assert "tt.dot" in text
    assert not re.search(r"@\S*_softmax_pv__\S*_cTrue\(%acc", text)  # no SAFE softmax without a mask


@pytest.mark.parametrize("qk_int8", [True, False])
def test_fp8_attention_kernel_builds_for_hopper_with_a_boolean_mask(qk_int8: bool) -> None:
    codes = "*i8" if qk_int8 else "*fp8e4nv"
    types = _typed(FP8_ATTENTION_ARGS, [codes, codes, "*fp8e4nv"] + ["*fp32"] * 4 + ["*bf16"] + ["i32"] * 8
                   + ["*u8", "*i32", "*i32"] + ["i32"] * 7 + NO_KEY_COUNTS)
    block_m, block_n, warps = fp8_triton.launch(True)
    text = triton_ir(fp8_triton._fp8_attention_kernel, types,
                     dict(D=128, BLOCK_M=block_m, BLOCK_N=block_n, QK_INT8=qk_int8, EXP_F16=False, LOOP=0, TMA=False,
                          INTERPRET=False, MASKED=True, KEY_COUNTS=False), num_warps=warps)
    # the some-pairs loop runs the softmax with SAFE (its last constexpr): rows that saw no allowed key yet
    assert re.search(r"@\S*_softmax_pv__\S*_cTrue\(%acc", text)


def test_fp8_attention_kernel_builds_for_hopper_with_key_counts() -> None:
    types = _typed(FP8_ATTENTION_ARGS, ["*i8", "*i8", "*fp8e4nv"] + ["*fp32"] * 4 + ["*bf16"] + ["i32"] * 8
                   + UNMASKED + ["*i32"])
    text = triton_ir(fp8_triton._fp8_attention_kernel, types,
                     dict(D=128, BLOCK_M=128, BLOCK_N=128, QK_INT8=True, EXP_F16=False, LOOP=0, TMA=False,
                          INTERPRET=False, MASKED=False, KEY_COUNTS=True))
    assert "%key_counts_ptr" in text and "tt.load %key_counts_ptr" not in text  # read at an offset: the batch's count


def test_mask_tiles_kernel_builds_for_hopper() -> None:
    types = _typed("mask_ptr states_ptr mask_rows k_tokens q_blocks k_blocks heads stride_mb stride_mh stride_mq "
                   "stride_mk", ["*u8", "*i8"] + ["i32"] * 9)
    text = triton_ir(mask_tiles._mask_tiles_kernel, types,
                     dict(BLOCK_M=128, BLOCK_N=128, ROWS=mask_tiles.TILE_ROWS_A_STEP))
    assert "tt.store" in text


def test_fp8_attention_kernel_builds_for_hopper_with_tma_descriptors_and_f16_exponentials() -> None:
    desc = "tensordesc<i8[128, 128]>"
    types = _typed(FP8_ATTENTION_ARGS, [desc, desc, "tensordesc<fp8e4nv[128, 128]>", "*fp32", "*fp32", "*fp32",
                                        "*fp32", "*bf16"] + ["i32"] * 8 + UNMASKED + NO_KEY_COUNTS)
    text = triton_ir(fp8_triton._fp8_attention_kernel, types,
                     dict(D=128, BLOCK_M=128, BLOCK_N=128, QK_INT8=True, EXP_F16=True, LOOP=0, TMA=True,
                          INTERPRET=False, MASKED=False, KEY_COUNTS=False))
    assert "ex2.approx.f16x2" in text


@pytest.mark.parametrize("mode,int8", [(fp8_triton.Q_MODE, True), (fp8_triton.Q_MODE, False), (fp8_triton.K_MODE, True),
                                       (fp8_triton.K_MODE, False), (fp8_triton.V_MODE, False)])  # V: e4m3 only
def test_fp8_quantize_kernel_builds_for_hopper_in_every_mode(mode: int, int8: bool) -> None:
    codes = "*i8" if int8 else "*fp8e4nv"
    types = _typed("x_ptr channel_ptr mean_ptr codes_ptr scales_ptr heads tokens blocks stride_b stride_h stride_s "
                   "multiplier", ["*bf16", "*fp32", "*fp32", codes, "*fp32"] + ["i32"] * 6 + ["fp32"])
    text = triton_ir(fp8_triton._quantize_kernel, types,
                     dict(D=128, BLOCK=128, MODE=mode, INT8=int8, INTERPRET=False))
    assert "tt.store" in text


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16"])
def test_fp8_attentions_channel_statistics_kernel_builds_for_hopper(dtype: str) -> None:
    types = _typed("k_ptr v_ptr k_sums_ptr v_sums_ptr v_max_ptr v_min_ptr heads tokens per_split splits k_stride_b "
                   "k_stride_h k_stride_s v_stride_b v_stride_h v_stride_s", [dtype, dtype] + ["*fp32"] * 4
                   + ["i32"] * 10)
    text = triton_ir(fp8_triton._channel_statistics_kernel, types, dict(D=128, BLOCK=fp8_triton.STATISTICS_BLOCK))
    assert "tt.reduce" in text and "scf.for" in text


STRIDES = "stride_b stride_h stride_s stride_d"


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16"])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("head", [64, 128, 256])  # the sizes FlashInfer's kernels run at
def test_per_head_e4m3_quantization_kernels_build_for_hopper(dtype: str, smooth: bool, head: int) -> None:
    mean = "*fp32" if smooth else dtype  # without smoothing the input stands in for the unread means
    amax = triton_ir(e4m3_triton._block_amax_kernel,
                     _typed(f"x_ptr mean_ptr amax_ptr heads tokens blocks {STRIDES}", [dtype, mean, "*fp32"]
                            + ["i32"] * 7), dict(D=head, BLOCK_S=e4m3_triton.BLOCK // head, SMOOTH=smooth),
                     num_warps=e4m3_triton.NUM_WARPS)
    cast = triton_ir(e4m3_triton._cast_kernel,
                     _typed(f"x_ptr mean_ptr inverse_ptr out_ptr heads tokens {STRIDES} out_b out_h out_s out_d",
                            [dtype, mean, "*fp32", "*fp8e4nv"] + ["i32"] * 10),
                     dict(D=head, BLOCK_S=e4m3_triton.BLOCK // head, SMOOTH=smooth, INTERPRET=False),
                     num_warps=e4m3_triton.NUM_WARPS)
    assert "tt.reduce" in amax and "tt.store" in cast


INT8_ATTENTION_ARGS = ("q_ptr k_ptr v_ptr qs_ptr ks_ptr out_ptr heads q_tokens k_tokens q_blocks k_blocks stride_vb "
                       "stride_vh stride_vs stride_ob stride_oh stride_os mask_ptr order_ptr counts_ptr stride_mb "
                       "stride_mh stride_mq stride_mk stride_cb stride_ch stride_cq key_counts_ptr")


@pytest.mark.parametrize("masked", [False, True])
def test_int8_attention_kernel_builds_for_hopper(masked: bool) -> None:
    types = _typed(INT8_ATTENTION_ARGS, ["*i8", "*i8", "*bf16", "*fp32", "*fp32", "*bf16"] + ["i32"] * 11
                   + (["*u8", "*i32", "*i32"] + ["i32"] * 7 if masked else UNMASKED) + NO_KEY_COUNTS)
    assert "tt.dot" in triton_ir(int8_triton._int8_attention_kernel, types,
                                 dict(D=128, BLOCK_M=128, BLOCK_N=64, MASKED=masked, KEY_COUNTS=False))


def test_int8_attention_kernel_builds_for_hopper_with_key_counts() -> None:
    types = _typed(INT8_ATTENTION_ARGS, ["*i8", "*i8", "*bf16", "*fp32", "*fp32", "*bf16"] + ["i32"] * 11
                   + UNMASKED + ["*i32"])
    text = triton_ir(int8_triton._int8_attention_kernel, types,
                     dict(D=128, BLOCK_M=128, BLOCK_N=64, MASKED=False, KEY_COUNTS=True))
    assert "%key_counts_ptr" in text and "tt.load %key_counts_ptr" not in text  # read at an offset: the batch's count


@pytest.mark.parametrize("two,gelu,fast", [(False, False, False), (True, True, True)])
def test_fp8_rows_kernel_builds_for_hopper(two: bool, gelu: bool, fast: bool) -> None:
    types = _typed("a_ptr b_ptr q_ptr s_ptr width_a width_b stride_a stride_b floor",
                   ["*bf16", "*bf16", "*fp8e4nv", "*fp32"] + ["i32"] * 4 + ["fp32"])
    text = triton_ir(fp8_rows_triton._fp8_quantize_rows_kernel, types,
                     dict(CHUNK=1024, NA=3, NB=2 if two else 0, GELU_A=gelu, GELU_B=gelu and two, FAST=fast))
    assert "tt.store" in text


def test_fp8_layer_norm_rows_kernel_builds_for_hopper() -> None:
    types = _typed("h_ptr a_ptr b_ptr q_ptr s_ptr width tokens stride_h stride_a stride_b eps floor",
                   ["*bf16", "*bf16", "*bf16", "*fp8e4nv", "*fp32"] + ["i32"] * 5 + ["fp32"] * 2)
    text = triton_ir(fp8_rows_triton._fp8_quantize_layer_norm_rows_kernel, types,
                     dict(BLOCK=4096, PTX=True, ROUNDED=True, ROWS=4), num_warps=8)
    assert "cvt.rn.bf16.f32" in text


def test_fp8_layer_norm_rows_kernel_builds_for_hopper_in_wans_float32_form() -> None:
    types = _typed("h_ptr a_ptr b_ptr q_ptr s_ptr width tokens stride_h stride_a stride_b eps floor",
                   ["*bf16", "*fp32", "*fp32", "*fp8e4nv", "*fp32"] + ["i32"] * 5 + ["fp32"] * 2)
    text = triton_ir(fp8_rows_triton._fp8_quantize_layer_norm_rows_kernel, types,
                     dict(BLOCK=8192, PTX=True, ROUNDED=False, ROWS=fp8_rows_triton.LAYER_NORM_ROWS[False]),
                     num_warps=8)  # the form's default tokens a program
    assert text.count("cvt.rn.bf16.f32") == 2  # y and the scale: one rounding each, none between the ops


@pytest.mark.parametrize("across,bf16_tables", [(False, False), (True, True)])
def test_norm_rope_kernel_builds_for_hopper(across: bool, bf16_tables: bool) -> None:
    table = "*bf16" if bf16_tables else "*fp32"
    types = _typed("x_ptr w_ptr cos_ptr sin_ptr out_ptr heads tokens out_tokens offset stride_xb stride_xs stride_cs "
                   "stride_cj cos_odd stride_ss stride_sj sin_odd eps",
                   ["*bf16", "*bf16", table, table, "*bf16"] + ["i32"] * 12 + ["fp32"])
    text = triton_ir(norm_rope_triton._rms_norm_rope_kernel, types,
                     dict(D=128, HEADS=32, ROUND_FIRST=True, ACROSS=across, BF16_TABLES=bf16_tables, PTX=True))
    assert "tt.store" in text


def test_a_kernel_the_gpu_compiler_refuses_is_refused_here() -> None:
    """The check can fail: a return typed int32 after a constexpr branch that returned fp32 (the bug it guards)."""
    import triton.language as tl
    from triton.compiler.errors import CompilationError

    @triton.jit
    def _inconsistent(x_ptr, FLOAT: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, 16))
        if FLOAT:
            return x.to(tl.float32)
        return x

    @triton.jit
    def _kernel(x_ptr, out_ptr, FLOAT: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, 16), _inconsistent(x_ptr, FLOAT))

    with pytest.raises(CompilationError):
        triton_ir(_kernel, {"x_ptr": "*i32", "out_ptr": "*fp32"}, {"FLOAT": True})
