"""A built wheel (not the editable checkout) carries the config tree, the recipes and the assets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """Build a wheel from a copy of the sources and install it, without deps, into a target dir."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("verl_dmd", "config", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(work / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (work / "dist").glob("verl_dmd-*.whl")
    site = work / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    return site


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH puts the installed copy ahead of the editable checkout's import hook.
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_wheel_holds_config_and_recipes(installed_wheel, tmp_path):
    """The installed package finds dmd2.yaml, the digits recipe and the shipped teacher inside itself."""
    code = (
        "import verl_dmd; from verl_dmd import config_dir, recipes_dir; "
        "from verl_dmd.assets import resolve_model_path as r; from pathlib import Path; "
        "print(verl_dmd.__file__); print(config_dir() / 'dmd2.yaml'); print(recipes_dir() / 'digits_dmd2.yaml'); "
        "print(Path(r('builtin:digits_teacher')) / 'diffusion_pytorch_model.safetensors')"
    )
    result = run_installed(installed_wheel, tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    module, base, recipe, teacher = (Path(line) for line in result.stdout.split())
    assert teacher.read_bytes() == (ROOT / "verl_dmd/assets/digits_teacher" / teacher.name).read_bytes()
    for path in (module, base, recipe, teacher):
        assert path.is_relative_to(installed_wheel), path
        assert path.is_file(), path


def test_installed_entry_point_composes_the_default_recipe(installed_wheel, tmp_path):
    """From outside the repo, the installed entry point composes the recipe through pkg:// paths."""
    result = run_installed(
        installed_wheel, tmp_path, "-m", "verl_dmd.main", "--dry-run", f"trainer.output_dir={tmp_path / 'o'}"
    )
    assert result.returncode == 0, result.stderr
    assert "plan fingerprint: " in result.stdout
