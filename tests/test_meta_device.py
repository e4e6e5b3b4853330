"""Skeletons built on the meta device (sizes and geometry without weights) leave no meta tensor in diffusers' modules,
also when one is the first thing a process builds. Each test runs a fresh Python: this process imported diffusers
long ago, and a module is only ever imported once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: prints the module-level tensors of diffusers' modules that are on the meta device
SCAN = """
import sys, torch
print([f"{n}.{k}" for n, m in list(sys.modules.items()) if n.startswith("diffusers")
       for k, v in vars(m).items() if isinstance(v, torch.Tensor) and v.device.type == "meta"])
"""


def fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("build", [
    "from hookkit.tools.bench import models; models.full_transformer_parameters('wan')",
    "from hookkit.tools import bench; bench.skeleton_pipeline(bench.ModelOptions(name='wan', full=True))",
    "from hookkit.tools import trained; trained.load_transformer()",
], ids=["full-size-count", "full-size-skeleton", "trained-model"])
def test_a_skeleton_built_first_in_a_process_leaves_no_meta_tensor_in_diffusers(build: str) -> None:
    assert fresh_python(build + SCAN) == "[]"


def test_magcache_runs_after_a_full_size_model_was_refused_in_the_same_process() -> None:
    """The size check of a refused full-size model built it on meta first; MagCache's shipped ratios stay real."""
    code = """
import tempfile
from pathlib import Path
from hookkit.errors import UnsupportedError
from hookkit.tools import bench
try:
    bench.load_pipeline(bench.ModelOptions(name="wan", full=True))
except UnsupportedError:
    pass
row = bench.measure(bench.CONFIGS["magcache"], bench.ModelOptions(name="wan", steps=4, frames=5), runs=1, warmup=0,
                    out_dir=Path(tempfile.mkdtemp()))
print(row["status"])
"""
    assert fresh_python(code) == "ok"
