"""scripts/gpu_product.py, the H200 product runs' driver, on the CPU with a tiny SD3 pipeline: the training
split over two invocations (`train --no-resume-check`, then `resume`), the SIGTERM landing between
checkpoints so the relaunch resumes from the signal's own save, and the refusals that save device time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def gpu_product(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "gpu_product.py"), "--family", "sd3", "--size", "tiny",
               "--device", "cpu", "--work", str(tmp_path / "work"), "--report", str(tmp_path / "report.json"),
               "--steps", "4", "--save-every", "2", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_training_in_two_invocations_resumes_from_the_signal_save_bit_for_bit(tmp_path):
    done = gpu_product(tmp_path, "--stages", "build,prepare,train", "--no-resume-check")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["train"]["straight"]["exit"] == 0 and report["train"]["comparison"].startswith("not run")

    # another command than the straight run's: refused before any training
    refused = gpu_product(tmp_path, "--stages", "resume", "--light")
    assert refused.returncode == 1 and "used another command" in refused.stdout, refused.stdout[-2000:]

    done = gpu_product(tmp_path, "--stages", "resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    train = json.loads((tmp_path / "report.json").read_text())["train"]
    assert train["comparison"]["bitwise_equal"] and train["comparison"]["files"] > 0, train["comparison"]
    assert train["sigterm_exit"] == 143 and train["stopped"]["code"] == train["straight"]["code"]
    work = tmp_path / "work" / "sd3"
    stopped = (work / "train_stopped.log").read_text()
    # the SIGTERM after step 3 falls between the checkpoints of steps 2 and 4: the signal's own save is used
    assert "checkpoints/global_step_2 " in stopped and "checkpoints/global_step_3 " in stopped, stopped[
        -2000:
    ]
    assert "stopped by SIGTERM at global step 3" in stopped
    assert "checkpoints/global_step_3 at global step 3" in (work / "train_resumed.log").read_text()


def test_a_sigterm_on_a_checkpoint_step_and_a_resume_without_a_straight_run_are_refused(tmp_path):
    done = gpu_product(tmp_path, "--stages", "train", "--steps", "3", "--save-every", "1", timeout=120)
    assert done.returncode == 2 and "signal's own save would be skipped" in done.stderr, done.stderr[-2000:]
    done = gpu_product(tmp_path, "--stages", "resume", "--no-resume-check", timeout=120)
    assert done.returncode == 2 and "cannot go with --no-resume-check" in done.stderr, done.stderr[-2000:]
    done = gpu_product(tmp_path, "--stages", "resume", timeout=120)
    assert done.returncode == 1 and "has no checkpoint global_step_4" in done.stdout, done.stdout[-2000:]
