"""Two identical runs write identical checkpoints, every file byte for byte (one of them stopped at its
first checkpoint); that run, moved to another output directory, resumes (its teacher pairs are
identified by what made them, not by their path) and ends with the checkpoint the uninterrupted run
wrote, byte for byte. One rank, no ray (`--local`); the
2-worker ray case is in tests/test_ray_trainer.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "legacy_checkpoint_1018912"
TEACHER = (
    "{"
    + ",".join(f"{k}:{v}" for k, v in json.loads((FIXTURE / "teacher_config.json").read_text()).items())
    + "}"
)
SMALL = [
    "algorithm.fake_update_ratio=1", "algorithm.fake_warmup_steps=1", "batch.student.micro_batch_size=4",
    "batch.fake_score.micro_batch_size=4", "validation.num_samples=10", "validation.roles=[student_ema]",
    "validation.sampling_steps=[1]", "checkpoint.save_every=2", f"model.teacher.config={TEACHER}",
    "model.teacher.path=null",
]  # fmt: skip


def local_run(out: Path, steps: int) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "verl_dmd.main", "--local", *SMALL, f"trainer.total_steps={steps}",
         f"trainer.output_dir={out}"],
        capture_output=True, text=True, timeout=600, cwd=out.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def files_of(checkpoint: Path) -> dict[str, bytes]:
    return {
        p.relative_to(checkpoint).as_posix(): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()
    }


def test_identical_runs_write_identical_checkpoints_and_a_moved_run_resumes_bit_for_bit(tmp_path):
    first, interrupted, moved = tmp_path / "first", tmp_path / "interrupted", tmp_path / "moved"
    local_run(first, 4)
    local_run(interrupted, 2)  # the same run, another process, stopped at its step-2 checkpoint
    a, b = (files_of(run / "checkpoints" / "global_step_2") for run in (first, interrupted))
    assert sorted(a) == sorted(b)
    assert [name for name in a if a[name] != b[name]] == []  # every file, byte for byte

    shutil.move(interrupted, moved)  # the whole run, pairs and checkpoints, somewhere else
    result = local_run(moved, 4)
    assert f"resumed from {moved / 'checkpoints' / 'global_step_2'}" in result.stdout
    assert (
        "regression pairs: " in result.stdout and "teacher samples" not in result.stdout
    )  # read, not remade
    a, b = (files_of(run / "checkpoints" / "global_step_4") for run in (first, moved))
    assert sorted(a) == sorted(b)
    assert [name for name in a if a[name] != b[name]] == []


def test_resources_deterministic_sets_the_kernels_before_any_model(tmp_path):
    """resources.deterministic: the worker's session turns on torch's deterministic algorithms (strict),
    cuDNN's deterministic mode without autotuning and cuBLAS's fixed workspace, before building its models."""
    code = (
        "import os, torch\n"
        "from verl_dmd.main import compose_plan\n"
        "from verl_dmd.workers.session import RankSession\n"
        "os.environ.pop('CUBLAS_WORKSPACE_CONFIG', None)\n"
        "plan = compose_plan('digits_dmd2', ['resources.deterministic=true', 'resources.device=cpu',\n"
        f"    'trainer.output_dir={tmp_path}'])\n"
        "assert not torch.are_deterministic_algorithms_enabled()\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "RankSession(plan, rank=0, world_size=1)\n"
        "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),\n"
        "      torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,\n"
        "      os.environ['CUBLAS_WORKSPACE_CONFIG'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-5:] == ["True", "False", "True", "False", ":4096:8"], result.stdout
