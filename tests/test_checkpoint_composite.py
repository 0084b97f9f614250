"""Composite checkpoints of the DMD2 stack: bitwise resume in fresh processes, plan drift, world size."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from composite_scenarios import one_rank_fails, resume_with, resumed, straight
from dist_harness import run_ranks

from verl_dmd.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.slow


def assert_equal_state(got: dict, want: dict, what: str) -> None:
    for part in ("schedule", "controller", "data"):
        assert got[part] == want[part], f"{what}: {part}"
    assert sorted(got["tensors"]) == sorted(want["tensors"])
    for key, tensor in want["tensors"].items():
        assert torch.equal(got["tensors"][key], tensor), f"{what}: {key}"
    for key, tensor in want["computer"].items():
        assert torch.equal(got["computer"][key], tensor), f"{what}: computer {key}"
    assert torch.equal(got["torch_rng"], want["torch_rng"]), f"{what}: torch RNG"


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_resume_in_fresh_processes_is_bitwise(tmp_path, layout):
    """2 ranks of DMD2 (4-step... here 2-step student, backward simulation): 2N phases straight equal
    N phases, a composite save, new processes that load it, and N phases: weights, EMA, both optimizers,
    schedules, controller, data position, computer generators and torch RNG."""
    root = str(tmp_path / "ckpt")
    first = run_ranks(straight, 2, tmp_path / "a", layout, root)
    second = run_ranks(resumed, 2, tmp_path / "b", layout, root)
    for rank in (0, 1):
        assert second[rank]["same_world"]
        assert_equal_state(second[rank]["loaded"], first[rank]["saved"], f"rank {rank} after load")
        assert_equal_state(second[rank]["final"], first[rank]["final"], f"rank {rank} after resuming")


def test_plan_drift_fails_before_loading_and_mutable_keys_pass(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(straight, 1, tmp_path / "a", "independent", root)
    (drift,) = run_ranks(resume_with, 1, tmp_path / "b", "independent", root, {"optim.student.lr": 5e-4})
    assert drift["untouched"], "weights were read before the plan check"
    assert "optim.student.lr: checkpoint 0.001, now 0.0005" in drift["error"]
    assert "checkpoint.resume=disable" in drift["error"]
    (mutable,) = run_ranks(resume_with, 1, tmp_path / "c", "independent", root, {"trainer.total_steps": 7})
    assert mutable == {"error": None, "step": 2}
    # Activation checkpointing is resume-mutable: it wraps blocks (renaming parameters in PyTorch), but
    # the checkpoint keys are canonical names, so a checkpoint loads with it switched on or off.
    (rewrapped,) = run_ranks(
        resume_with, 1, tmp_path / "d", "independent", root, {"model.activation_checkpointing": True}
    )
    assert rewrapped == {"error": None, "step": 2}


def test_resume_at_another_world_size_restores_weights_and_optimizers(tmp_path):
    """Saved at 2 ranks, resumed at 1: every saved tensor and counter comes back; the per-rank random
    streams cannot map one to one, so they are re-seeded from (seed, step, rank) instead (documented)."""
    root = str(tmp_path / "ckpt")
    first = run_ranks(straight, 2, tmp_path / "a", "independent", root)
    (second,) = run_ranks(resumed, 1, tmp_path / "b", "independent", root)
    assert not second["same_world"]
    saved, loaded = first[0]["saved"], second["loaded"]
    for part in ("schedule", "controller", "data"):
        assert loaded[part] == saved[part], part
    for key, tensor in saved["tensors"].items():
        assert torch.equal(loaded["tensors"][key], tensor), key
    # The per-rank streams are re-seeded from (seed, step, rank): not a replay of the run's first draws.
    for name, state in second["fresh_start"].items():
        assert not torch.equal(loaded["computer"][name], state), name


KILL_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from composite_scenarios import PHASES, Stack
    from verl_dmd.checkpoint.store import CheckpointStore

    root, kill_at = sys.argv[1], sys.argv[2]
    def hook(point):
        if point == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    stack = Stack(0, 1, "independent")
    assert stack.load(root).global_step == 2
    stack.run(PHASES)
    stack.save(root, store=CheckpointStore(root, fault_hook=hook))
    """
)


def test_training_continues_bitwise_after_a_save_is_killed(tmp_path):
    """SIGKILL during the composite save (after the DCP files, the RNG files, the manifest, just before the
    rename): `auto` then resumes the previous checkpoint, and the continued run equals an uninterrupted
    one bit for bit (the store's own test kills at each of its 28 publication points)."""
    root = str(tmp_path / "ckpt")
    (first,) = run_ranks(straight, 1, tmp_path / "a", "independent", root)
    code = KILL_CHILD.format(tests=str(Path(__file__).parent))
    for point in ("engine", "rng", "manifest:write", "rename"):
        result = subprocess.run([sys.executable, "-c", code, root, point], capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.returncode == -signal.SIGKILL, (point, result.stderr[-3000:])
        assert [p.name for p in Path(root).iterdir() if p.name.startswith(".staging-")], point
        assert CheckpointStore(root).resolve("auto", hashes=True).global_step == 2, point
    (second,) = run_ranks(resumed, 1, tmp_path / "b", "independent", root)  # asserts it loaded step 2
    assert_equal_state(second["final"], first["final"], "after the killed saves")


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_fsdp_granularity_and_resharding_do_not_change_the_math(tmp_path, layout):
    """model.fsdp_units=model and model.reshard_after_forward=false (the digits recipe's speed settings)
    give bit for bit the weights, EMA and optimizer states of the default sharding, on 2 ranks."""
    from composite_scenarios import sharding_variant

    (default, _) = run_ranks(sharding_variant, 2, tmp_path / "a", layout, {})
    fast = {"model.fsdp_units": "model", "model.reshard_after_forward": False}
    (variant, _) = run_ranks(sharding_variant, 2, tmp_path / "b", layout, fast)
    assert_equal_state(variant, default, "fsdp_units=model, reshard_after_forward=false")


def test_a_step_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """Reading a manifest, listing the checkpoints, setting newer ones aside, every write of a save, and rank
    0's warning of a damaged checkpoint under -W error, failing on one rank alone: that rank raises its own
    error, every other rank a CheckpointError naming it (no rank is left waiting in a collective), and the
    ranks stay in step (a load then works)."""
    ranks = run_ranks(one_rank_fails, 2, tmp_path / "ranks", "independent", str(tmp_path / "ckpt"))
    got = [{name: (kind, message) for name, kind, message in results} for results in ranks]
    for rank in (0, 1):
        assert got[rank]["verify"] == ("CheckpointError", "manifest.json: unreadable on rank 1 alone")
        assert got[rank]["begin"] == ("CheckpointError", "global_step = -1: must be an integer >= 0")
        assert got[rank]["load"] == ("none", "2")
    for name, failing, kind in [("candidates", 0, "PermissionError"), ("set_aside", 0, "OSError"),
                                ("publish", 0, "OSError"), ("rng", 1, "OSError")]:  # fmt: skip
        assert got[failing][name][0] == kind, (name, got[failing][name])
        other = got[1 - failing][name]
        assert other[0] == "CheckpointError" and other[1].startswith(f"rank {failing} failed ({kind}: "), (
            other
        )
    # rank 0's warning of a damaged checkpoint, an error under -W error there
    for name, damage in [("warn_listed", "skipping damaged checkpoint: global_step_9: manifest.json: not JSON"),
                         ("warn_damaged", ": engine: a hash does not match")]:  # fmt: skip
        kind, message = got[0][name]
        assert (kind, message.startswith("skipping damaged"), message.endswith(damage)) == (
            "UserWarning",
            1,
            1,
        )
        assert got[1][name] == ("CheckpointError", f"rank 0 failed (UserWarning: {message})"), got[1][name]
