"""The hydra entry point as a user runs it: `python -m verl_dmd.main` and `verl-dmd`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_main(*args: str, tmp_path: Path, dry_run: bool = True) -> subprocess.CompletedProcess:
    """The entry point; with dry_run it prints the plan and schedule instead of training."""
    flags = ["--dry-run"] if dry_run else []
    return subprocess.run(
        [sys.executable, "-m", "verl_dmd.main", *flags, f"trainer.output_dir={tmp_path / 'out'}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )


def expected_schedule(k: int, warmup: int, n: int) -> list[str]:
    """Independent statement of the schedule: warmup fakes, then (student, K fakes) cycles."""
    cycle = ["student"] + ["fake_score"] * k
    sequence = ["fake_score"] * warmup
    while len(sequence) < n:
        sequence += cycle
    return sequence[:n]


def test_dry_run_prints_plan_and_schedule(tmp_path):
    """`--dry-run` validates the default recipe and prints the plan, its fingerprint and the schedule."""
    result = run_main(tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "adapter: dit" in out
    fingerprint = next(line for line in out.splitlines() if line.startswith("plan fingerprint: "))
    assert len(fingerprint.split(": ")[1]) == 64
    schedule = next(line for line in out.splitlines() if line.startswith("first 16 phases"))
    assert schedule.split(": ", 1)[1].split() == expected_schedule(4, 10, 16)
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing trained
    assert "world size: 2 worker(s) on cpu" in out


def test_dry_run_local_says_it_runs_one_rank(tmp_path):
    """`--dry-run --local` reports the one rank the local backend runs, not the plan's two workers."""
    result = run_main("--local", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("world size: "))
    assert line.startswith("world size: 1 rank on cpu (--local; resources asks for 2 workers"), line


def test_override_changes_the_schedule(tmp_path):
    """Dotted overrides reach the plan."""
    result = run_main("algorithm.fake_update_ratio=3", "algorithm.fake_warmup_steps=0", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    schedule = next(line for line in result.stdout.splitlines() if line.startswith("first 16 phases"))
    assert schedule.split(": ", 1)[1].split() == expected_schedule(3, 0, 16)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "algorithm.fake_update_ratio=0",
            "config key 'algorithm.fake_update_ratio' = 0: must be an integer >= 1",
        ),
        ("+algorithm.fake_update_ration=5", "config key 'algorithm.fake_update_ration' is unknown"),
        ("optim.student.lr='1e-4'", "config key 'optim.student.lr' = '1e-4': must be a number"),
        (
            "model.teacher.path=/no/such/model",
            "config key 'model.teacher.path' = '/no/such/model': no such local",
        ),
    ],
)
def test_bad_config_is_one_line_error_without_traceback(override, needle, tmp_path):
    """Plan errors exit with status 2 and one line on stderr, never a traceback, before ray starts
    (the run is a real one, not a dry run)."""
    result = run_main(override, tmp_path=tmp_path, dry_run=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("verl-dmd: error: ") and needle in lines[-1], result.stderr


def test_console_script_lists_recipes():
    """`verl-dmd --list-recipes` lists the packaged recipes with the default marked."""
    script = Path(sys.executable).parent / "verl-dmd"
    result = subprocess.run([str(script), "--list-recipes"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "digits_dmd2  (default)" in result.stdout
