"""scripts/run_phases.py: the runtime without ray, launched by torchrun as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_torchrun_two_cpu_ranks_run_the_schedule():
    """2 gloo ranks run 4 phases in DMD2 order (K=2) and report every phase as stepped."""
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "scripts/run_phases.py",
            "--phases",
            "4",
            "--layout",
            "independent",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    phases = [line.split() for line in result.stdout.splitlines() if line.startswith("phase ")]
    assert [p[2] for p in phases] == ["student", "fake_score", "fake_score", "student"]
    assert all("stepped True" in " ".join(p) for p in phases)
    assert "student_steps=2, fake_steps=2" in result.stdout


def test_bad_arguments_are_one_line_errors():
    """Invalid arguments fail before any process group starts."""
    result = subprocess.run(
        [sys.executable, "scripts/run_phases.py", "--phases", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2 and "--phases 0: must be >= 1" in result.stderr
