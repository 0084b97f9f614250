"""Engine state through DCP: bitwise continuation at the same world size, and resharding 2 <-> 1 ranks."""

from __future__ import annotations

import pytest
import torch
from checkpoint_scenarios import load_and_continue, save_then_continue
from dist_harness import run_ranks

PHASES = 4  # fake (warm-up), student, fake, fake: both optimizers hold state at the save
pytestmark = pytest.mark.slow


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["schedule"] == want["schedule"], what
    assert sorted(got["tensors"]) == sorted(want["tensors"]), what
    assert any(k.startswith("optim/fake_score/") for k in want["tensors"])
    assert any(k.startswith("optim/student/") for k in want["tensors"])
    for key, tensor in want["tensors"].items():
        assert torch.equal(got["tensors"][key], tensor), f"{what}: {key}"


@pytest.mark.parametrize("layout", ["shared_base_adapters", "independent"])
def test_resume_continues_bit_for_bit(tmp_path, layout):
    """2 ranks: n phases, save, n phases == n phases, save, fresh processes load, n phases."""
    directory = str(tmp_path / "dcp")
    straight = run_ranks(save_then_continue, 2, tmp_path / "a", "sd3", layout, directory, PHASES)
    saved = straight[0]["saved"]
    resumed = run_ranks(load_and_continue, 2, tmp_path / "b", "sd3", layout, directory, PHASES, saved)
    for rank in (0, 1):
        assert_same(resumed[rank]["loaded"], saved, f"loaded on rank {rank}")
        assert_same(resumed[rank]["final"], straight[rank]["final"], f"continued on rank {rank}")


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size_restores_every_tensor(tmp_path, save_world, load_world):
    """Saved at one world size, loaded at another: parameters, EMA and both optimizers' state equal."""
    directory = str(tmp_path / "dcp")
    straight = run_ranks(
        save_then_continue, save_world, tmp_path / "a", "sd3", "independent", directory, PHASES
    )
    saved = straight[0]["saved"]
    resumed = run_ranks(
        load_and_continue, load_world, tmp_path / "b", "sd3", "independent", directory, PHASES, saved
    )
    for rank in range(load_world):
        assert_same(resumed[rank]["loaded"], saved, f"loaded on rank {rank} of {load_world}")
