"""Every example runs on the CPU with tiny models, as `python examples/<name>.py`, and says what it proves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hookkit.techniques.cache.spec import resolve_steps_mask

pytestmark = pytest.mark.slow  # every example runs as a subprocess

REPO = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> str:
    # `python examples/x.py` puts examples/ first on sys.path, not the checkout: point it at this checkout's
    # hookkit, not whichever one the environment has installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""  # no torchao/torch/diffusers import chatter (hookkit.core.quiet), no progress bars
    return proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU path of the example")
def test_flux_fast() -> None:
    out = run_example("flux_fast.py", "--steps", "12")
    mask = resolve_steps_mask("fast", 12)
    cached = [i for i, m in enumerate(mask) if m == 0]
    assert "hookkit summary: FluxTransformer2DModel in FluxPipeline" in out
    assert f"cached steps: {len(cached)} of 12: {cached}" in out
    assert re.search(r"^plain: \d+\.\d{3} s, hookkit: \d+\.\d{3} s \(\d+\.\d\dx\); PSNR vs plain: \d+\.\d\d dB$", out, re.MULTILINE)
    assert "bitwise equal to the plain run after hookkit.disable: True" in out
    assert "no CUDA device: on one, this example would add hookkit.Compile(regional=True, cuda_graphs='transformer')" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU path of the example")
def test_qwen_image_cuda_graphs() -> None:
    out = run_example("qwen_image_cuda_graphs.py", "--steps", "4")
    assert "hookkit.compile.step_mark    on <transformer>" in out
    for i in range(3):  # the tiny Qwen-Image has 3 blocks, each its own compiled region
        assert f"hookkit.compile.inner        on transformer_blocks.{i}" in out
    assert "hookkit.memo.prologue        on <transformer>" in out
    assert ("cuda_graphs='transformer' on this machine: UnsupportedError: Compile.cuda_graphs='transformer' needs a "
            "CUDA device") in out
    # memo: the first of the 2 x 4 lookups builds modulate_index; the table outlives a call, so the 7 others hit
    assert "memoized index tensors: 7 hits, 1 misses in 2 calls of 4 steps" in out
    assert "memo: (CPU timings of a tiny model measure nothing; run on a GPU); output vs plain: bitwise equal" in out
    assert "bitwise equal to the plain run after hookkit.disable: True" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU path of the example")
def test_cogvideox_sync_free() -> None:
    out = run_example("cogvideox_sync_free.py", "--steps", "4")
    assert "CogVideoXTransformer3DModel._repeated_blocks = []" in out
    assert "stock compile_repeated_blocks: ValueError: `_repeated_blocks` attribute is empty." in out
    assert ("hookkit adapter repeated_blocks = ['CogVideoXBlock']: Compile(regional=True) compiles "
            "['transformer_blocks.0', 'transformer_blocks.1', 'transformer_blocks.2']") in out
    # dynamic CFG reads t.item() once per step: each answered from the host copy
    assert "sync-free: CogVideoXDDIMScheduler with CPU tables mapped: True; timestep reads answered on the host: 4" in out
    assert "this example would count host syncs per step and place with hookkit.profile_syncs" in out
    assert "sync-free output vs plain: bitwise equal" in out
    assert "bitwise equal to the plain run after hookkit.disable: True" in out


def test_custom_adapter() -> None:
    out = run_example("custom_adapter.py", "--steps", "8")
    assert ("before registering: hookkit derives 'derived:TinyDiT' from its code: "
            "[('blocks', 'hidden_states', ('hidden_states',))]") in out
    assert "registered adapter 'tinydit' for ['TinyDiT']: 6 blocks in ['blocks']" in out
    assert "hookkit summary: TinyDiT (bare transformer)" in out
    assert "| cache   | hookkit.cache.middle | blocks.{1..5} |" in out
    assert "cached steps: [2, 3, 5, 6] of 8" in out  # the zeros of the mask [1, 1, 0, 0, 1, 0, 0, 1]
    assert "bitwise equal to the unhooked run after handle.remove(): True" in out
    assert "nothing left on the model: True" in out
