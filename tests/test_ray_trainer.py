"""The main job end to end: `verl-dmd` on 2 CPU ray workers, SIGTERM and resume, and failing ranks."""

from __future__ import annotations

import hashlib
import json
import os
import re
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
    # where the workers' start went, from rank 0's own clock; the remainder is the driver's side
    ready = re.search(r"^workers ready on cpu in ([\d.]+) s \(rank 0: process group ([\d.]+) s, model build "
                      r"([\d.]+) s, placement and sharding ([\d.]+) s, optimizers and the rest ([\d.]+) s, matmul "
                      r"probe ([\d.]+) s; the rest \(([\d.]+) s\): worker start, imports, ray\)$",
                      straight.stdout, re.M)  # fmt: skip
    assert ready, straight.stdout[:3000]
    total, *parts, rest = map(float, ready.groups())
    # 7 figures printed to 0.1 s: their sum is within 7 x 0.05 s of the total
    assert abs(total - sum(parts) - rest) <= 7 * 0.05 + 1e-9 and rest > 0
    assert all(part >= 0 for part in parts)  # (the digits model builds in under 0.05 s)

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
    # Every file of the final checkpoint, byte for byte (both ranks' RNG files and DCP shards included):
    # the 2-worker runs are deterministic and the resume exact.
    final_a, final_b = (tmp_path / run / "checkpoints" / "global_step_6" for run in ("a", "b"))
    names = sorted(p.relative_to(final_a).as_posix() for p in final_a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(final_b).as_posix() for p in final_b.rglob("*") if p.is_file())
    assert "rng/rank_1.pt" in names and "engine/__1_0.distcp" in names
    assert [n for n in names if (final_a / n).read_bytes() != (final_b / n).read_bytes()] == []


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


STEP_1 = "{out}/checkpoints/global_step_1"


@pytest.mark.parametrize(
    ("worker", "timeout", "message", "checkpointing", "note"),
    [
        (
            "RaisingWorker",
            600,
            "worker call run_phase failed on rank 1: ValueError: injected failure on purpose",
            [],  # the recipe saves every 200 steps: none before the failure
            "verl-dmd: with checkpoint.resume = 'auto', relaunching the same command starts from step 0 (no "
            "checkpoint yet; checkpoint.save_every = 200)",
        ),
        (
            "DyingWorker",
            600,
            "worker call run_phase: rank 1 died",
            ["checkpoint.save_every=1"],  # step 1's checkpoint is published before the third phase
            f"verl-dmd: relaunching the same command resumes from {STEP_1} (global step 1 of 6)",
        ),
        (
            "SaveDyingWorker",  # the save call fails, but the checkpoint is on disk: the line names it
            600,
            "worker call save_checkpoint: rank 1 died",
            ["checkpoint.save_every=1"],
            f"verl-dmd: relaunching the same command resumes from {STEP_1} (global step 1 of 6)",
        ),
        (
            "HangingWorker",
            20,
            "worker call run_phase: rank(s) [1] stopped answering (phase 2, fake_score; at ray_workers.py:",
            ["checkpoint.save_every=1", "checkpoint.resume=disable"],
            "verl-dmd: with checkpoint.resume = 'disable', relaunching the same command starts from step 0; the "
            f"newest checkpoint is {STEP_1} (global step 1)",
        ),
    ],
)
def test_a_failing_rank_ends_the_run_with_its_rank_and_error(
    tmp_path, worker, timeout, message, checkpointing, note
):
    """Rank 1 raises, dies or hangs in its third phase, or dies right after its part of a save: the
    driver names the rank (and the original error), stops the workers and exits non-zero within the
    timeout, then says what relaunching the same command starts from, as the checkpoint root shows it
    (a save that failed on the driver's side but was published counts). A hang names rank 1 alone as
    the rank that stopped (rank 0 waits for it in a collective) and points to a log of both ranks'
    stacks."""
    from verl_dmd.checkpoint.store import CheckpointStore

    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", FAULT_DRIVER.format(tests=str(TESTS)), worker, *TINY,
         f"trainer.output_dir={tmp_path}", f"trainer.rpc_timeout_s={timeout}", *checkpointing],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "VERL_DMD_TEST_HANG_S": "600"},
    )  # fmt: skip
    elapsed, exited = time.monotonic() - started, time.time()
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 1, output
    assert message in result.stdout + result.stderr, output
    assert note.format(out=tmp_path) in result.stderr.splitlines(), output
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("global_step_*"))
    assert saved == (["global_step_1"] if checkpointing else []), (saved, output)
    if checkpointing:  # the checkpoint the line names is complete, every file's hash as its manifest says
        CheckpointStore.verify(tmp_path / "checkpoints" / "global_step_1", hashes=True)
    assert elapsed < 200, elapsed
    if worker == "HangingWorker":
        check_hang_report(result.stderr, timeout, exited)


def check_hang_report(stderr: str, timeout: float, exited: float) -> None:
    """The timeout's one line and the log it names: rank 1 stopped in ray_workers.py's sleep, rank 0 waits
    in torch.distributed, both stacks are there, and the report came within timeout + 5 s of the
    hanging phase's start (as rank 1 recorded it)."""
    import re

    line = next(line for line in stderr.splitlines() if "worker call run_phase" in line)
    assert "rank(s) [0] were waiting for them in a collective" in line, line
    assert "within trainer.rpc_timeout_s = 20 s" in line and line.endswith("the workers were stopped"), line
    assert "[0, 1]" not in line, line
    log = Path(re.search(r"every rank's stack: (\S+);", line).group(1))
    text = log.read_text()
    rank0 = text.split("== rank 0: ")[1].split("== rank 1: ")[0]
    rank1 = text.split("== rank 1: ")[1]
    assert rank0.startswith("waiting in a collective") and "/torch/distributed/" in rank0, text[-6000:]
    assert rank1.startswith("stopped answering, not in a collective (at ray_workers.py:"), text[-6000:]
    assert "ray_workers.py" in rank1 and "in run_phase" in rank1 and "/torch/distributed/" not in rank1
    for rank_text in (rank0, rank1):
        assert "operation: run_phase" in rank_text and "request: phase 2, fake_score" in rank_text
        assert "(most recent call first):" in rank_text  # a faulthandler dump
    hang_started = float(re.search(r"started_unix: ([0-9.]+)", rank1).group(1))
    reported = float(re.search(r"report written: .* \(unix ([0-9.]+),", text).group(1))
    assert timeout - 1 <= reported - hang_started <= timeout + 5, (reported - hang_started, text[:2000])
    print(f"timeout {timeout} s: reported {reported - hang_started:.2f} s after rank 1's phase began; the "
          f"driver exited (ray shut down) {exited - hang_started:.2f} s after it")  # fmt: skip


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
