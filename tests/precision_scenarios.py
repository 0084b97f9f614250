"""The rank-side scenario of tests/test_mixed_precision_inputs.py: one student loss's LoRA gradients from the
engine in float32 and in bf16, with the timestep kept float32 (the adapter's full_precision_inputs) or cast."""

from __future__ import annotations

import torch
from runtime_scenarios import make_plan

from verl_dmd.adapters import get_adapter
from verl_dmd.phases import Role
from verl_dmd.runtime.engine import RoleEngine


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def student_gradients(rank: int, world_size: int, family: str) -> dict:
    out = {}
    for name, dtype, keep in (("float32", "float32", True), ("bf16", "bfloat16", True),
                              ("bf16_cast_timestep", "bfloat16", False)):  # fmt: skip
        plan = make_plan(family, "shared_base_adapters", **{"model.param_dtype": dtype})
        adapter = get_adapter(family)()
        if not keep:
            adapter.full_precision_inputs = ()  # the behaviour before: FSDP2 casts every floating input
        engine = RoleEngine(plan, adapter)
        model = engine.module_for(Role.STUDENT)
        seen = []
        model.register_forward_pre_hook(
            lambda m, a, k, seen=seen: seen.append(str(k["timestep"].dtype)), with_kwargs=True
        )
        generator = torch.Generator().manual_seed(5)
        x0, cond = adapter.example_batch(model, 4, generator)
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.rand(4, generator=generator) * 0.8 + 0.1
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        with engine.trainable(Role.STUDENT), engine.use_role(Role.STUDENT) as module:
            v = adapter.predict(module, (1 - s) * x0 + s * noise, sigma, cond)
            ((v.float() - (noise - x0)) ** 2).mean().backward()
            grads = {
                engine.param_names[id(p)]: _full(p.grad).float().clone() for p in engine.params[Role.STUDENT]
            }
        out[name] = {"grads": grads, "timestep_dtypes": sorted(set(seen))}
    return out
