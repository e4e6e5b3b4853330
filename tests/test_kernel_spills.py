"""benchmarks/kernel_spills.py: the loops of a kernel's machine code and their spills, and hookkit_fp8's key loops.

Why: `hookkit_fp8`'s unmasked kernel once spilled registers in every key block as the GPU machine's Triton built it (a
`where` in the epilogue), 43 % slower on an H100 with the same arithmetic; the interpreter tests could not see it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

#: `cuobjdump -sass` lines of a made-up kernel: a loop 0x0020-0x0060 with one spill store and two spill loads (one
#: predicated), a forward branch, and a second loop 0x0080-0x0090 without spills
SASS = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;              /* 0x00000a0000017a02 */
        /*0010*/                   BRA 0x80 ;                          /* 0x0000000000007947 */
        /*0020*/                   STL.64 [R1+0x10], R4 ;              /* 0x0000100401007387 */
        /*0030*/                   LDL R6, [R1+0x10] ;                 /* 0x0000100001067983 */
        /*0040*/               @P0 LDL.64 R8, [R1+0x18] ;              /* 0x0000180001080983 */
        /*0050*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0060*/               @P1 BRA 0x20 ;                          /* 0xfffffffc00087947 */
        /*0070*/                   EXIT ;                              /* 0x000000000000794d */
        /*0080*/                   IADD3 R2, R2, 0x1, RZ ;             /* 0x0000000102027810 */
        /*0090*/               @P2 BRA 0x80 ;                          /* 0xfffffffc00087947 */
"""


def builds_for_hopper(test: Callable[..., None]) -> Callable[..., None]:
    """A test that builds a kernel for Hopper: skipped under the interpreter; marked `hopper_build`, which the GPU
    suite runs too, so that the GPU machine's Triton, whose builds differ from this machine's, builds it as well."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
    skip = pytest.mark.skipif(interpreted, reason="TRITON_INTERPRET is set: the kernels are interpreted, not compiled")
    return pytest.mark.hopper_build(skip(test))


@pytest.fixture(scope="module")
def spills(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("kernel_spills")


def test_loops_are_the_backward_branches_with_their_spill_stores_and_loads(spills: ModuleType) -> None:
    assert spills.loops(SASS) == [spills.Loop(start=0x20, end=0x60, instructions=5, spill_stores=1, spill_loads=2),
                                  spills.Loop(start=0x80, end=0x90, instructions=2, spill_stores=0, spill_loads=0)]


def test_a_forward_branch_makes_no_loop(spills: ModuleType) -> None:
    forward_only = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA 0x30 ;
        /*0020*/                   STL [R1], R4 ;
        /*0030*/                   EXIT ;
"""
    assert spills.loops(forward_only) == []


@builds_for_hopper
def test_unmasked_fp8_kernel_spills_nothing_in_its_key_loop_at_wan_14b_call(spills: ModuleType) -> None:
    pytest.importorskip("triton")
    kernel, args, kwargs = spills.fp8_attention_launch(tokens=32760, heads=40, dim=128, masked=False)
    row = spills.report(spills.build(kernel, args, kwargs))
    assert len(row["loops"]) == 1
    assert row["loops"][0]["spill_stores"] == 0


@builds_for_hopper
def test_fp8_kernel_under_key_counts_spills_nothing_in_its_key_loop_at_hunyuanvideo15s_call(
        spills: ModuleType) -> None:
    pytest.importorskip("triton")
    kernel, args, kwargs = spills.fp8_attention_launch(tokens=34745, heads=16, dim=128, key_counts=True)
    row = spills.report(spills.build(kernel, args, kwargs))
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"]) == (128, 128, 4)
    assert len(row["loops"]) == 1
    assert row["loops"][0]["spill_stores"] == 0


@builds_for_hopper
def test_int8_kernel_under_key_counts_spills_nothing_in_its_key_loop_at_hunyuanvideo15s_call(
        spills: ModuleType) -> None:
    pytest.importorskip("triton")
    kernel, args, kwargs = spills.int8_attention_launch(tokens=34745, heads=16, dim=128, key_counts=True)
    row = spills.report(spills.build(kernel, args, kwargs))
    assert len(row["loops"]) == 1
    assert row["loops"][0]["spill_stores"] == 0


@builds_for_hopper
def test_masked_fp8_kernel_as_launched_spills_nothing_in_its_key_loops(spills: ModuleType) -> None:
    pytest.importorskip("triton")
    kernel, args, kwargs = spills.fp8_attention_launch(tokens=34745, heads=16, dim=128, masked=True)
    row = spills.report(spills.build(kernel, args, kwargs))
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"]) == (64, 128, 4)
    assert [loop["spill_stores"] for loop in row["loops"]] == [0, 0]


@builds_for_hopper
def test_mask_tile_classification_at_hunyuanvideo15s_mask_spills_nothing(spills: ModuleType) -> None:
    pytest.importorskip("triton")
    kernel, args, kwargs = spills.mask_tiles_launch(tokens=34745)
    row = spills.report(spills.build(kernel, args, kwargs))
    assert (row["spill_store_bytes"], row["spill_load_bytes"]) == (0, 0)


@builds_for_hopper
def test_the_report_covers_every_attention_launch_and_names_its_triton(spills: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    import triton

    result = spills.main(["--tokens", "4096", "--heads", "8", "--out", str(tmp_path / "spills.json")])
    assert set(result["kernels"]) == {"hookkit_fp8", "hookkit_fp8 key counts", "hookkit_fp8 masked",
                                      "hookkit_fp8 masked 8 warps 128x128", "hookkit_fp8 masked 4 warps 128x128",
                                      "hookkit_fp8 masked 4 warps 128x64", "mask tiles", "hookkit_int8",
                                      "hookkit_int8 masked", "hookkit_int8 key counts"}
    assert json.loads((tmp_path / "spills.json").read_text())["triton"] == triton.__version__
