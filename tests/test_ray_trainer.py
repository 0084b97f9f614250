"""The main job end to end: `verl-dmd` on 2 CPU ray workers, SIGTERM and resume, and failing ranks."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow

# The digits recipe with tiny settings: 6 student steps of K=1, small batches, a small validation.
TINY = [
    "trainer.total_steps=6", "algorithm.fake_update_ratio=1", "algorithm.fake_warmup_steps=1",
    "algorithm.regression_weight=0", "batch.student.micro_batch_size=4", "batch.fake_score.micro_batch_size=4",
    "validation.num_samples=10", "validation.roles=[student_ema]", "validation.sampling_steps=[1]",
]  # fmt: skip


def verl_dmd(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "verl-dmd"), *TINY, *args]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def final_state(out: Path) -> tuple[dict, str]:
    """The final checkpoint's trainer state and the hash of the exported student weights."""
    state = json.loads((out / "checkpoints" / "global_step_6" / "trainer_state.json").read_text())
    weights = (
        out / "export" / "global_step_6" / "student_ema" / "diffusers" / "diffusion_pytorch_model.safetensors"
    )
    return state, sha256(weights)


def test_sigterm_saves_and_the_same_command_resumes_to_the_same_result(tmp_path):
    """Uninterrupted run vs. a run stopped by SIGTERM after step 2 and relaunched with the same command:
    the stopped run publishes a checkpoint and exits 143; the relaunch resumes from it and ends with the
    same controller counters, data position, schedule and (bit for bit) the same exported weights.
    The signal goes to the driver's pid: with the local ray cluster the driver starts, ray's own daemons
    share its process group and stop on SIGTERM (docs/quickstart.md says so)."""
    straight = subprocess.run(verl_dmd(f"trainer.output_dir={tmp_path / 'a'}"), capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)  # fmt: skip
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]

    command = verl_dmd(f"trainer.output_dir={tmp_path / 'b'}")
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("step      2/6"):
            process.send_signal(signal.SIGTERM)
            break
    rest, _ = process.communicate(timeout=300)
    output = "".join(seen) + rest
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "received SIGTERM" in output and "stopped by SIGTERM at global step" in output
    saved = sorted((tmp_path / "b" / "checkpoints").glob("global_step_*"))
    assert saved and int(saved[-1].name.split("_")[-1]) < 6, output[-3000:]

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {saved[-1]}" in resumed.stdout
    want_state, want_weights = final_state(tmp_path / "a")
    got_state, got_weights = final_state(tmp_path / "b")
    assert got_state == want_state
    assert got_state["trainer"]["controller"]["student_steps"] == 6
    assert got_weights == want_weights
    assert (tmp_path / "b" / "samples" / "student_ema_1step.png").is_file()


FAULT_DRIVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import ray
    import ray_workers
    from verl_dmd.main import compose_plan
    from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

    plan = compose_plan("digits_dmd2", sys.argv[2:])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={{"env_vars": {{"PYTHONPATH": {tests!r}}}}})
    code = DistillationRayTrainer(plan, worker_cls=getattr(ray_workers, sys.argv[1])).fit()
    ray.shutdown()
    sys.exit(code)
    """
)


@pytest.mark.parametrize(
    ("worker", "timeout", "message"),
    [
        (
            "RaisingWorker",
            600,
            "worker call run_phase failed on rank 1: ValueError: injected failure on purpose",
        ),
        ("DyingWorker", 600, "worker call run_phase: rank 1 died"),
        ("HangingWorker", 20, "did not answer within trainer.rpc_timeout_s = 20 s"),
    ],
)
def test_a_failing_rank_ends_the_run_with_its_rank_and_error(tmp_path, worker, timeout, message):
    """Rank 1 raises, dies or hangs in its third phase: the driver names the rank (and the original
    error), stops the workers and exits non-zero within the timeout."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", FAULT_DRIVER.format(tests=str(TESTS)), worker, *TINY,
         f"trainer.output_dir={tmp_path}", f"trainer.rpc_timeout_s={timeout}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "VERL_DMD_TEST_HANG_S": "600"},
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert message in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    assert elapsed < 200, elapsed


def test_a_stop_after_fake_phases_keeps_the_checkpoint_of_the_same_global_step(tmp_path):
    """Checkpoints are named by global step: a stop after a save at step N and some fake-score phases
    (no student step since) keeps that checkpoint instead of publishing step N again (which the store
    refuses); a stop after the next student step saves anew."""
    from types import SimpleNamespace

    from verl_dmd.trainer.ray_trainer import Checkpoints

    saved = []

    class Group:
        def save_checkpoint(self, global_step, state):
            saved.append(global_step)
            return f"global_step_{global_step}"

    class Provider:
        def state_dict(self):
            return {"position": 0}

    checkpoints = Checkpoints(plan=None, group=Group(), log=lambda line: None)
    controller = SimpleNamespace(phase_index=5, global_step=2, state_dict=lambda: {})
    assert checkpoints.save(controller, Provider()) == "global_step_2"
    controller.phase_index = 8  # three fake-score phases later, still global step 2
    assert checkpoints.save(controller, Provider()) == "global_step_2"
    assert saved == [2]
    controller.phase_index, controller.global_step = 9, 3
    assert checkpoints.save(controller, Provider()) == "global_step_3"
    assert saved == [2, 3]
