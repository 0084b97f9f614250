"""The rank-side scenario of tests/test_throughput.py: phase FLOPs priced on the meta device against a
direct count of the live phase, and a run with the counter against one without."""

from __future__ import annotations

import torch
from dmd2_scenarios import dmd2_batch
from runtime_scenarios import make_plan, request_for
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from verl_dmd.adapters import get_adapter
from verl_dmd.controller import DistillationController
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.runtime import DistillationRoleRuntime


def _runtime(family: str, layout: str):
    plan = make_plan(family, layout, **{"algorithm.fake_update_ratio": 1, "algorithm.fake_warmup_steps": 0})
    adapter = get_adapter(family)()
    computer = adapter.build_distribution_matching_computer(plan.model, plan, rank=0)
    engine = RoleEngine(plan, adapter, extra_modules=computer.extra_modules())
    return adapter, engine, DistillationRoleRuntime(engine, computer)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def count_phases(rank: int, world_size: int, family: str, layout: str) -> dict:
    """Four phases (student, fake, student, fake: the second of each is priced from the cache) on a runtime
    and on a twin whose counter is closed, the twin's phases run under FlopCounterMode.

    Both run attention as its matmuls (the math kernel): torch's counter has no formula for the fused CPU
    kernel, so a direct count of it would leave attention out, where the meta-device pricing counts it.
    """
    with sdpa_kernel(SDPBackend.MATH):
        return _count_phases(family, layout)


def _count_phases(family: str, layout: str) -> dict:
    adapter, engine, runtime = _runtime(family, layout)
    _, twin_engine, twin = _runtime(family, layout)
    twin.flops.close()
    controllers = [DistillationController(fake_update_ratio=1, fake_warmup_steps=0) for _ in range(2)]
    phases = []
    for phase in range(4):
        request = request_for(controllers[0])
        assert request_for(controllers[1]) == request
        batch = dmd2_batch(adapter, engine.module_for(request.role), 4, seed=phase)
        metrics = runtime.run_phase(request, batch)
        direct = FlopCounterMode(display=False)
        with direct:
            twin_metrics = twin.run_phase(request, batch)
        for controller, m in zip(controllers, (metrics, twin_metrics), strict=True):
            controller.record(request.role, stepped=m["stepped"])
        role = request.role.value
        phases.append({
            "role": role, "ours": metrics.get(f"perf/{role}/flops"), "direct": direct.get_total_flops(),
            "samples": metrics[f"perf/{role}/samples"], "seconds": metrics[f"perf/{role}/seconds"],
            "twin_has_flops": f"perf/{role}/flops" in twin_metrics,
        })  # fmt: skip
    ours = {k: _full(v) for model in engine.models.values() for k, v in model.state_dict().items()}
    theirs = {k: _full(v) for model in twin_engine.models.values() for k, v in model.state_dict().items()}
    differing = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    return {
        "phases": phases,
        "differing": differing,
        "tensors": len(ours),
        "unpriced": runtime.flops.unpriced,
    }
