"""A distillation method from a separately installed package is found through its entry-point group and
trained by `verl-dmd --local`; an unknown method name is a one-line error listing the registered ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "thirdparty_method"
VERL_DMD = str(Path(sys.executable).parent / "verl-dmd")
pytestmark = pytest.mark.slow

TINY = [
    "algorithm.name=toy_regression", "trainer.total_steps=2", "algorithm.fake_update_ratio=1",
    "algorithm.fake_warmup_steps=1", "algorithm.regression_weight=0", "algorithm.student_steps=1",
    "batch.student.micro_batch_size=4", "batch.fake_score.micro_batch_size=4", "validation.num_samples=10",
    "validation.roles=[student]", "validation.sampling_steps=[1]", "trainer.progress_bar=false",
]  # fmt: skip


def methods(env=None) -> str:
    code = "from verl_dmd.algorithms import available_methods; print(available_methods())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=True).stdout  # fmt: skip


def test_entry_point_method_is_found_and_trains(tmp_path):
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
    assert "toy_regression" in methods(env) and "dmd2" in methods(env)
    assert "toy_regression" not in methods()  # it really comes from the installed package

    out = tmp_path / "out"
    run = subprocess.run([VERL_DMD, "--local", *TINY, f"trainer.output_dir={out}"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "student/toy_mse:" in run.stdout and "fake_score/toy_fake:" in run.stdout
    manifest = json.loads((out / "checkpoints" / "global_step_2" / "manifest.json").read_text())
    assert manifest["plan"]["algorithm"]["name"] == "toy_regression"
    assert manifest["counters"]["student_steps"] == 2
    assert (out / "export" / "global_step_2" / "student_ema" / "diffusers" / "config.json").is_file()

    unknown = subprocess.run([VERL_DMD, "--dry-run", "algorithm.name=toy_regresion"], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    assert unknown.returncode == 2
    (line,) = unknown.stderr.strip().splitlines()
    assert line.startswith(
        "verl-dmd: error: config key 'algorithm.name' = 'toy_regresion': no such distillation"
    )
    assert "registered: dmd2, toy_regression" in line and "verl_dmd.algorithms" in line
