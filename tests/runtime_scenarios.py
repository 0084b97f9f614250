"""Shared set-up for the runtime tests: tiny model configs, plans, and the rank-side scenarios."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from verl_dmd.adapters import get_adapter
from verl_dmd.algorithms.reference import ReferenceRegressionComputer, regression_batch
from verl_dmd.controller import DistillationController
from verl_dmd.phases import PhaseRequest, Role
from verl_dmd.plan import DistillationPlan
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime

TINY_CONFIGS = {
    family: get_adapter(family).tiny_config for family in ("sd3", "flux", "qwen_image", "wan", "dit")
}


FAKE_UPDATE_RATIO = 2
WARMUP = 1
PHASES = 5  # fake, student, fake, fake, student
MICRO_BATCH = 2
ACCUMULATION = 2


def make_plan(family: str, layout: str, **overrides) -> DistillationPlan:
    config = {
        "model": {
            "adapter": family,
            "storage": layout,
            "teacher": {"config": TINY_CONFIGS[family]},
            "student": {"lora": {"rank": 4}},
            "fake_score": {"lora": {"rank": 4}},
        },
        "data": {"name": "synthetic"},
        "algorithm": {"fake_update_ratio": FAKE_UPDATE_RATIO, "fake_warmup_steps": WARMUP},
        "optim": {
            # The student's clip is below its gradient norm, so clipping is exercised.
            "student": {"lr": 1e-3, "grad_clip": 0.01},
            "fake_score": {"lr": 2e-3, "weight_decay": 0.0},
        },
        "batch": {
            role: {"micro_batch_size": MICRO_BATCH, "accumulation_steps": ACCUMULATION}
            for role in ("student", "fake_score")
        },
        "ema": {"decay": 0.9},
        "trainer": {"seed": 7},
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return DistillationPlan.from_config(config)


def request_for(controller: DistillationController) -> PhaseRequest:
    role = controller.next_phase()
    role_step = controller.student_steps if role is Role.STUDENT else controller.fake_steps
    return PhaseRequest(
        role=role, global_step=controller.global_step, role_step=role_step, phase_index=controller.phase_index
    )


def global_batch(adapter, model, world_size: int, phase: int) -> dict[str, torch.Tensor]:
    return regression_batch(adapter, model, MICRO_BATCH * ACCUMULATION * world_size, seed=1000 + phase)


def local_part(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(world_size)[rank] for k, v in batch.items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def strip_model_prefix(name: str) -> str:
    return name.split(".", 1)[1]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build and run everything in `dtype` (float64 trajectories need no rounding slack)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def probe_batch(adapter, model, world_size: int) -> dict[str, torch.Tensor]:
    return global_batch(adapter, model, world_size, 99)


def train_and_probe(rank: int, world_size: int, family: str, layout: str, **overrides) -> dict:
    """PHASES phases on this rank's share of each global batch; then full weights, per-role
    forwards, and the full gradients of one more student phase from the trained state."""
    plan = make_plan(family, layout, **overrides)
    adapter = get_adapter(family)()
    engine = RoleEngine(plan, adapter)
    runtime = DistillationRoleRuntime(engine, ReferenceRegressionComputer(adapter))
    controller = DistillationController(fake_update_ratio=FAKE_UPDATE_RATIO, fake_warmup_steps=WARMUP)
    norms = []
    for phase in range(PHASES):
        request = request_for(controller)
        batch = global_batch(adapter, engine.module_for(request.role), world_size, phase)
        metrics = runtime.run_phase(request, local_part(batch, rank, world_size))
        controller.record(request.role, stepped=metrics["stepped"])
        norms.append((request.role.value, metrics[f"{request.role.value}/grad_norm"]))
    weights = {}
    for role in (Role.STUDENT, Role.FAKE_SCORE, Role.STUDENT_EMA):
        if role is Role.STUDENT_EMA and layout == "independent":
            continue
        for p in engine.params[role]:
            weights[f"{role.value}:{strip_model_prefix(engine.param_names[id(p)])}"] = (
                full(p).detach().clone()
            )
    for p, ema in zip(engine.params[Role.STUDENT], engine.ema.own_tensors, strict=False):  # empty when shared
        weights[f"student_ema:{strip_model_prefix(engine.param_names[id(p)])}"] = full(ema).detach().clone()
    probe = probe_batch(adapter, engine.module_for(Role.STUDENT), world_size)
    cond = {k[5:]: v for k, v in probe.items() if k.startswith("cond.")}
    forwards = {}
    with torch.no_grad():
        for role in Role:
            with engine.use_role(role) as module:
                forwards[role.value] = adapter.predict(module, probe["x_t"], probe["sigma"], cond).clone()
    # One more student phase, stopped before the step, to read the reduced gradients.
    request = PhaseRequest(role=Role.STUDENT, global_step=0, role_step=0, phase_index=0)
    engine.zero_grad(Role.STUDENT)
    with engine.trainable(Role.STUDENT), engine.use_role(Role.STUDENT):
        output = runtime.computer.compute_phase(
            request,
            local_part(probe, rank, world_size),
            runtime.view,
            micro_batch_index=0,
            num_micro_batches=1,
        )
        output.loss.backward()
    grads = {
        f"student:{strip_model_prefix(engine.param_names[id(p)])}": full(p.grad).clone()
        for p in engine.params[Role.STUDENT]
    }
    engine.zero_grad(Role.STUDENT)
    # how the trained parameters are laid out: (mesh dimension names, mesh shape, placements)
    placements = sorted({
        (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape), str(p.placements))
        for role in (Role.STUDENT, Role.FAKE_SCORE)
        for p in engine.params[role]
    })  # fmt: skip
    dist.barrier()
    return {
        "weights": weights,
        "forwards": forwards,
        "norms": norms,
        "grads": grads,
        "placements": placements,
    }


CASES = [
    (family, layout)
    for family in ("sd3", "flux", "qwen_image", "wan")
    for layout in ("shared_base_adapters", "independent")
]


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def all_cases(rank: int, world_size: int) -> dict:
    """Every (family, layout, dtype) case in one spawn: imports dominate a rank process's cost."""
    results = {}
    for family, layout in CASES:
        for dtype_name, dtype in DTYPES.items():
            with default_dtype(dtype):
                results[f"{family}/{layout}/{dtype_name}"] = train_and_probe(rank, world_size, family, layout)
    return results


def compiled_and_eager(rank: int, world_size: int, layout: str) -> dict:
    """The same training and probes with model.compile (aot_eager: dynamo's capture and guards and
    AOTAutograd's forward/backward graphs, without code generation) and without, in float64."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.utils import counters

    # Running out of graph variants would fall back to eager silently, and eager equals eager: fail.
    dynamo_config.fail_on_recompile_limit_hit = True
    # Compiled with the other same-math settings flipped too (activation checkpointing wraps the
    # compiled blocks; kept-gathered weights), against plain eager.
    compiled_options = {
        "model.compile": True,
        "model.compile_backend": "aot_eager",
        "model.activation_checkpointing": True,
        "model.reshard_after_forward": False,
    }
    with default_dtype(torch.float64):
        eager = train_and_probe(rank, world_size, "sd3", layout)
        before = int(counters["stats"].get("unique_graphs", 0))
        compiled = train_and_probe(rank, world_size, "sd3", layout, **compiled_options)
        graphs = int(counters["stats"].get("unique_graphs", 0)) - before
    return {"eager": eager, "compiled": compiled, "graphs": graphs}


HYBRID = {"model.fsdp_mesh": [2, 2], "resources.nnodes": 2, "resources.workers_per_node": 2}
"""A (replicate 2, shard 2) mesh on 4 ranks, as 2 nodes of 2 workers would run it."""
HYBRID_CASES = [("sd3", "shared_base_adapters"), ("wan", "independent")]


def hybrid_cases(rank: int, world_size: int) -> dict:
    """The float64 trajectory of `HYBRID_CASES` on a hybrid mesh."""
    results = {}
    for family, layout in HYBRID_CASES:
        with default_dtype(torch.float64):
            results[f"{family}/{layout}"] = train_and_probe(rank, world_size, family, layout, **HYBRID)
    return results


REPLICATE = {"model.fsdp_mesh": "replicate", "resources.workers_per_node": 2}
"""Whole models on every rank (a (2, 1) mesh on 2 ranks): gradients all-reduced, nothing gathered."""


@contextlib.contextmanager
def norm_without_collectives():
    """The runtime's gradient norm, with a `torch.distributed.all_reduce` inside it an AssertionError (every
    rank holds the whole gradient on a replicate mesh: the norm needs no collective)."""
    from verl_dmd.runtime import runtime as runtime_module

    original = runtime_module._total_grad_norm

    def refuse(*args, **kwargs):
        raise AssertionError("the gradient norm ran an all_reduce on a replicate mesh")

    def guarded(*args, **kwargs):
        real, dist.all_reduce = dist.all_reduce, refuse
        try:
            return original(*args, **kwargs)
        finally:
            dist.all_reduce = real

    runtime_module._total_grad_norm = guarded
    try:
        yield
    finally:
        runtime_module._total_grad_norm = original


def replicate_cases(rank: int, world_size: int) -> dict:
    """The float64 trajectory of `HYBRID_CASES` on a replicate mesh, the gradient norm without collectives."""
    results = {}
    for family, layout in HYBRID_CASES:
        with default_dtype(torch.float64), norm_without_collectives():
            results[f"{family}/{layout}"] = train_and_probe(rank, world_size, family, layout, **REPLICATE)
    return results
