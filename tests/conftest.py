"""Shared fixtures: tiny pipelines from config (random weights, CPU), quiet warnings, GPU marker."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Tests compile the same block classes on many models in one process (one xdist worker runs whichever tests it is
    given): without a reset, dynamo's per-code-object cache (8 entries) fills up across tests and a later test fails
    on the recompile limit, depending on which tests shared its worker."""
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _silent_library() -> Iterator[None]:
    """Every test starts and ends with hookkit silent (its default), even one that ran `hookkit -v ...`."""
    import hookkit

    yield
    hookkit.set_verbosity(None)


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], ModuleType]:
    """Import one of `benchmarks/*.py` (not a package) by file name, to test its functions in process."""
    def load(name: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up there)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture
def interpreted(tmp_path: Path) -> Callable[[str], Any]:
    """Run a script in a fresh Python with Triton's CPU interpreter on (`TRITON_INTERPRET=1` must be set before a
    kernel is defined, so not in this process); return the JSON of its last output line."""
    def run(script: str) -> Any:
        path = tmp_path / "interpreted.py"
        path.write_text('import os\nos.environ["TRITON_INTERPRET"] = "1"\n' + script)
        done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    return run

