"""Rank side of the export tests: train a few phases from a teacher on disk, save, record role outputs."""

from __future__ import annotations

import torch
from runtime_scenarios import global_batch, local_part, make_plan, request_for

from verl_dmd.adapters import get_adapter
from verl_dmd.algorithms.reference import ReferenceRegressionComputer
from verl_dmd.checkpoint.composite import save_checkpoint
from verl_dmd.checkpoint.store import CheckpointStore
from verl_dmd.controller import DistillationController
from verl_dmd.phases import Role
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime

PHASES = 5  # fake (warm-up), student, fake, fake, student: the EMA has moved away from the student


def export_plan(family: str, layout: str, teacher_dir: str, **overrides):
    """The test plan with the teacher loaded from `teacher_dir` (as a user's would be)."""
    settings = {
        "model.teacher.config": None,
        "model.teacher.path": teacher_dir,
        "ema.start_step": 0,
        **overrides,
    }
    return make_plan(family, layout, **settings)


def fixed_inputs(adapter, model):
    x, cond = adapter.example_batch(model, 3, torch.Generator().manual_seed(11))
    return x, torch.tensor([0.9, 0.5, 0.2]), cond


def train_and_save(rank: int, world_size: int, family: str, layout: str, teacher_dir: str, root: str,
                   overrides: dict) -> dict:  # fmt: skip
    plan = export_plan(family, layout, teacher_dir, **overrides)
    adapter = get_adapter(family)()
    engine = RoleEngine(plan, adapter)
    runtime = DistillationRoleRuntime(engine, ReferenceRegressionComputer(adapter))
    controller = DistillationController(fake_update_ratio=2, fake_warmup_steps=1)
    for phase in range(PHASES):
        request = request_for(controller)
        batch = global_batch(adapter, engine.module_for(request.role), world_size, phase)
        assert runtime.run_phase(request, local_part(batch, rank, world_size))["stepped"]
        controller.record(request.role, stepped=True)
    path = save_checkpoint(CheckpointStore(root), engine, plan, global_step=controller.global_step,
                           trainer_state={"controller": controller.state_dict()}, rank_state={})  # fmt: skip
    outputs = {}
    for role in (Role.STUDENT, Role.STUDENT_EMA, Role.TEACHER):
        with engine.use_role(role) as model, torch.no_grad():
            x, sigma, cond = fixed_inputs(adapter, model)
            outputs[role.value] = adapter.predict(model, x, sigma, cond).detach().clone()
    return {"path": str(path), "outputs": outputs}
