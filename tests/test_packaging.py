"""The adapter files and the trained models ship inside the wheel and are found from an installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {f"{name}.toml" for name in (
    "chroma", "cogvideox", "cogview4", "cosmos", "flux", "flux2", "hidream", "hunyuanvideo", "hunyuanvideo15", "ltx2",
    "ltxvideo", "lumina2", "mochi", "qwenimage", "sana", "sd3", "skyreelsv2", "wan", "wan_vace", "zimage")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True,
    )
    (path,) = out.glob("hookkit-*.whl")
    return path


@pytest.mark.slow
def test_wheel_contains_every_adapter_file(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {Path(n).name for n in names if n.startswith("hookkit/_adapters/")} == SHIPPED


@pytest.mark.slow
def test_wheel_contains_every_trained_model_and_the_classifier(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    trained = "hookkit/tools/trained/"
    assert {f"{trained}{name}" for name in ("model.safetensors", "classifier.safetensors", "MODEL_CARD.md")} <= names
    for folder in ("deep", "video"):
        assert {f"{trained}{folder}/{name}" for name in ("model.safetensors", "MODEL_CARD.md", "samples.png")} <= names


@pytest.mark.slow
def test_installed_wheel_finds_its_adapters_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import hookkit, hookkit.adapters as a; print(a.adapters_dir()); "
            "print(sorted(hookkit.list_adapters()))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    where, names = result.stdout.strip().splitlines()[-2:]
    assert where == str(target / "hookkit" / "_adapters")
    assert names == str(sorted(Path(n).stem for n in SHIPPED))
