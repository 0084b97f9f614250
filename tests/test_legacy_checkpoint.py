"""A checkpoint written by the code before the refactor of issue 16 (commit 1018912) resumes today and
trains the next step bit for bit as the old code did (tests/fixtures/legacy_checkpoint_1018912)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from verl_dmd.checkpoint.export import read_role_tensors
from verl_dmd.main import compose_plan
from verl_dmd.runtime.naming import RoleTensors
from verl_dmd.trainer.ray_trainer import DistillationRayTrainer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "legacy_checkpoint_1018912"
pytestmark = pytest.mark.slow


def cpu_vendor() -> str:
    """The processor's vendor_id (GenuineIntel, AuthenticAMD), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("layout", ["independent", "shared"])
def test_a_checkpoint_of_the_previous_main_resumes_bit_for_bit(tmp_path, layout):
    # Training rounds differently with torch's CPU kernels on other processors than the box that recorded
    # the fixture (AVX2; Intel's AVX-512): where a layout has a recording made on this CPU capability and
    # vendor, or on this capability (by the same old code), use it.
    source = FIXTURE / layout
    capability = torch.backends.cpu.get_cpu_capability()
    for tag in (f"{capability}.{cpu_vendor()}", capability):
        if (FIXTURE / f"{layout}.{tag}").is_dir():
            source = FIXTURE / f"{layout}.{tag}"
            break
    overrides = source.joinpath("overrides.txt").read_text().split()
    out = tmp_path / "run"
    tiny = (
        f"model.teacher.config={json.dumps(json.loads(FIXTURE.joinpath('teacher_config.json').read_text()))}"
    )
    # keys added since and recipe settings changed since, at what the old code and recipe had
    later = FIXTURE.joinpath("later_overrides.txt").read_text().split()
    plan = compose_plan("digits_dmd2", [*overrides, *later, tiny, f"trainer.output_dir={out}"])
    shutil.copytree(source / "global_step_1", out / "checkpoints" / "global_step_1")
    lines = []
    assert DistillationRayTrainer(plan, backend="local", log=lines.append).fit() == 0
    assert any("resumed from" in line and "global_step_1" in line for line in lines), lines

    expected = json.loads((source / "expected_step2.json").read_text())
    engine = out / "checkpoints" / "global_step_2" / "engine"
    got = read_role_tensors(engine, RoleTensors(prefix="", adapter=None, model_name=""))
    assert sorted(got) == sorted(expected["tensors"])
    for key, want in expected["tensors"].items():
        assert (list(got[key].shape), str(got[key].dtype)) == (want["shape"], want["dtype"]), key
        assert digest(got[key]) == want["sha256"], key
    state = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    assert state["trainer"] == expected["trainer_state"]["trainer"]
    for role, entry in expected["trainer_state"]["schedule"].items():  # written in the earlier format
        scheduler = state["schedule"][role]["scheduler"]
        assert state["schedule"][role]["lr"] == entry["lr"]
        assert (scheduler["last_epoch"], scheduler["_step_count"]) == (
            entry["last_epoch"],
            entry["step_count"],
        )
