"""Rank side of the engine checkpoint tests: train, save with DCP, continue; or load and continue."""

from __future__ import annotations

from runtime_scenarios import (
    FAKE_UPDATE_RATIO,
    WARMUP,
    full,
    global_batch,
    local_part,
    make_plan,
    request_for,
)

from verl_dmd.adapters import get_adapter
from verl_dmd.algorithms.reference import ReferenceRegressionComputer
from verl_dmd.checkpoint.engine_state import (
    engine_state,
    load_engine,
    load_schedule_state,
    save_engine,
    schedule_state,
)
from verl_dmd.controller import DistillationController
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime


def _build(family: str, layout: str, overrides: dict | None = None):
    plan = make_plan(family, layout, **(overrides or {}))
    adapter = get_adapter(family)()
    engine = RoleEngine(plan, adapter)
    runtime = DistillationRoleRuntime(engine, ReferenceRegressionComputer(adapter))
    controller = DistillationController(fake_update_ratio=FAKE_UPDATE_RATIO, fake_warmup_steps=WARMUP)
    return adapter, engine, runtime, controller


def _run(adapter, engine, runtime, controller, rank, world_size, phases) -> None:
    for phase in phases:
        request = request_for(controller)
        batch = global_batch(adapter, engine.module_for(request.role), world_size, phase)
        metrics = runtime.run_phase(request, local_part(batch, rank, world_size))
        assert metrics["stepped"], metrics
        controller.record(request.role, stepped=True)


def snapshot(engine) -> dict:
    tensors = {k: full(v).detach().clone() for k, v in engine_state(engine).items()}
    return {"tensors": tensors, "schedule": schedule_state(engine)}


def save_then_continue(
    rank: int,
    world_size: int,
    family: str,
    layout: str,
    directory: str,
    n: int,
    overrides: dict | None = None,
) -> dict:
    """n phases (the fake warm-up and a student step among them), save, then n more phases; `overrides`:
    plan keys (make_plan's dotted form)."""
    adapter, engine, runtime, controller = _build(family, layout, overrides)
    _run(adapter, engine, runtime, controller, rank, world_size, range(n))
    save_engine(engine, directory)
    saved = {**snapshot(engine), "controller": controller.state_dict()}
    _run(adapter, engine, runtime, controller, rank, world_size, range(n, 2 * n))
    return {"saved": saved, "final": snapshot(engine)}


def load_and_continue(
    rank: int,
    world_size: int,
    family: str,
    layout: str,
    directory: str,
    n: int,
    saved: dict,
    overrides: dict | None = None,
) -> dict:
    """A fresh engine (new process): load, then the same n phases as after the save."""
    adapter, engine, runtime, controller = _build(family, layout, overrides)
    load_engine(engine, directory)
    load_schedule_state(engine, saved["schedule"])
    controller.load_state_dict(saved["controller"])
    loaded = snapshot(engine)
    _run(adapter, engine, runtime, controller, rank, world_size, range(n, 2 * n))
    return {"loaded": loaded, "final": snapshot(engine)}
