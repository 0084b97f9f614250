"""A model adapter from a separately installed package is found through the entry-point group and used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "thirdparty_adapter"
pytestmark = pytest.mark.slow


def test_entry_point_adapter_is_found_and_trains(tmp_path):
    """Install the fixture package as a wheel, then run two runtime phases with its adapter."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # the venv's setuptools (torch requires it): an isolated build would fetch one from the index each time
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}

    listed = subprocess.run(
        [sys.executable, "-c", "from verl_dmd.adapters import available_adapters; print(available_adapters())"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    assert "thirdparty_example" in listed.stdout

    run = subprocess.run(
        [sys.executable, "scripts/run_phases.py", "--family", "thirdparty_example", "--phases", "2"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "built shared_base_adapters thirdparty_example" in run.stdout
    assert run.stdout.count("stepped True") == 2

    without = subprocess.run(
        [sys.executable, "-c", "from verl_dmd.adapters import available_adapters; print(available_adapters())"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "thirdparty_example" not in without.stdout  # it really came from the installed package
