"""The digits scripts run end to end at toy sizes (the real runs and their numbers: docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_dmd.adapters import get_adapter
from verl_dmd.adapters.base import ModelSource

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def table_rows(stdout: str, first_column: set[str]) -> list[list[str]]:
    return [
        line.split() for line in stdout.splitlines() if line.split()[:1] and line.split()[0] in first_column
    ]


def test_train_digits_teacher_writes_a_loadable_model_and_its_table(tmp_path):
    """A few training steps save a diffusers directory and print FID/accuracy for 5 step counts."""
    result = run("scripts/train_digits_teacher.py", "--out", str(tmp_path / "t"), "--steps", "3",
                 "--eval-samples", "20", "--guidance", "1.0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = table_rows(result.stdout, {"1.0"})
    assert [int(r[1]) for r in rows] == [1, 2, 4, 8, 32]
    assert all(float(r[2]) > 0 and 0 <= float(r[3]) <= 1 for r in rows)
    get_adapter("dit")().build_model(ModelSource(path=str(tmp_path / "t")))


def test_distill_digits_runs_dmd2_cycles_and_reports_quality(tmp_path):
    """Two DMD2 cycles on a (random) teacher directory, then the student/EMA quality table."""
    torch.manual_seed(0)
    adapter = get_adapter("dit")()
    teacher = adapter.build_model(ModelSource(config=adapter.tiny_config))
    teacher.save_pretrained(tmp_path / "teacher")
    result = run("scripts/distill_digits.py", "--teacher", str(tmp_path / "teacher"), "--cycles", "2",
                 "--eval-samples", "20", "algorithm.fake_warmup_steps=1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = table_rows(result.stdout, {"student", "student_ema"})
    assert [(r[0], int(r[1])) for r in rows] == [
        ("student", 1),
        ("student", 4),
        ("student_ema", 1),
        ("student_ema", 4),
    ]


def test_distill_digits_needs_a_teacher_directory(tmp_path):
    """A missing teacher is a one-line usage error, not a traceback."""
    result = run("scripts/distill_digits.py", "--teacher", str(tmp_path / "none"))
    assert result.returncode == 2 and "no config.json" in result.stderr and "Traceback" not in result.stderr
