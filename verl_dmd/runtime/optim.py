"""Per-role AdamW optimizers and learning-rate schedules built from the plan."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR

from verl_dmd.plan import OptimSpec, SchedulerSpec


def build_adamw(params: Sequence[torch.nn.Parameter], spec: OptimSpec) -> torch.optim.AdamW:
    """AdamW over an explicit parameter list (never `model.parameters()`: see TRAPS, per-role optimizers)."""
    if not params:
        raise ValueError("an optimizer needs at least one parameter; the role has none to train")
    # foreach=True: the single-tensor path dispatches every DTensor op separately, several times more host
    # time per step (scripts/bench_host.py, docs/benchmarks.md); the updated weights are bitwise equal.
    # tests/test_runtime_equivalence.py checks against an unsharded single-tensor reference.
    return torch.optim.AdamW(
        list(params),
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        foreach=True,
    )


def lr_multiplier(spec: SchedulerSpec, step: int) -> float:
    """The factor on the peak lr after `step` optimizer steps (LambdaLR's convention)."""
    if spec.name == "constant":
        return 1.0
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.name == "warmup_constant":
        return 1.0
    progress = min(1.0, (step - spec.warmup_steps) / spec.decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, spec: SchedulerSpec) -> LambdaLR:
    """A LambdaLR stepping once per successful optimizer step of its role."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(spec, step))


class LocalShardStep:
    """`optimizer.step()` for an AdamW over FSDP2's DTensor parameters, run on their local shards.

    The update of a sharded parameter is elementwise, so it is the same on the local shard: the same
    foreach operations of the same `torch.optim.AdamW` code, on the local tensors of the parameters,
    gradients and moments (the DTensor path unwraps to exactly these; tests compare bit for bit). What
    it saves is host time: each foreach operation on DTensors goes through DTensor's dispatch, a large
    share of the step's host time for LoRA roles (scripts/bench_host.py, docs/benchmarks.md), and the GPU
    idles during the step (it runs after the gradient norm is read back).

    A shadow AdamW holds the local parameters; its state entries are the same tensor objects as the real
    optimizer's (the moments' local tensors and the very `step` counters), so the real optimizer, its
    checkpoints and its schedulers see every update. The real `step()` runs instead whenever the shadow
    would not mirror it exactly: a parameter that is not a DTensor or has no state yet (AdamW makes it at
    the first step), a gradient or moment that is not a DTensor placed and shaped like its parameter,
    step hooks, a `step` replaced on the optimizer object (a wrapper other than the LR scheduler's, which
    only marks the step as called), or a differentiable, fused or capturable optimizer (defaults or any
    group). A new shadow is built when any object it mirrors changed: a parameter, its local tensor
    (`module.to(...)` swaps them), a state tensor or its local tensor (a load that replaced them).
    `forget()` drops the shadow (the offloader calls it at sleep: a shadow built before a load would
    otherwise keep the replaced tensors alive on the device).
    """

    STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._shadow: torch.optim.Optimizer | None = None
        self._mirrored: list[object] = []  # the objects the shadow was built from, compared with `is`
        self._locals: list[list[torch.Tensor]] = []
        self.counts = {"local": 0, "real": 0, "built": 0}  # steps taken each way, shadows built

    def _mirrorable(self) -> list[object] | None:
        """The objects a shadow mirrors, in order; None when the real step must run."""
        from torch.distributed.tensor import DTensor
        from torch.optim import optimizer as optimizer_module

        optimizer = self.optimizer
        flags = ("differentiable", "fused", "capturable")
        if any(group.get(k) for group in (optimizer.defaults, *optimizer.param_groups) for k in flags) or (
            self._step_wrapped()
            or optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks
            or getattr(optimizer_module, "_global_optimizer_pre_hooks", None)
            or getattr(optimizer_module, "_global_optimizer_post_hooks", None)
        ):
            return None
        objects: list[object] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not isinstance(p, DTensor) or not state or set(state) != self.STATE_KEYS:
                    return None
                grad = p.grad
                if grad is not None and (not isinstance(grad, DTensor) or grad.placements != p.placements):
                    return None
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                for moment in (exp_avg, exp_avg_sq):
                    if (
                        not isinstance(moment, DTensor)
                        or moment.placements != p.placements
                        or moment._local_tensor.shape != p._local_tensor.shape
                    ):
                        return None
                objects += [p, p._local_tensor, state["step"], exp_avg, exp_avg._local_tensor, exp_avg_sq,
                            exp_avg_sq._local_tensor]  # fmt: skip
        return objects

    def _step_wrapped(self) -> bool:
        """True when something replaced `step` on the optimizer object (not the LR scheduler's marker)."""
        step = self.optimizer.__dict__.get("step")
        if step is None:
            return False
        # LRScheduler wraps the class's step once to set `_opt_called` (which `step()` below sets too)
        return not (
            getattr(step, "_wrapped_by_lr_sched", False)
            and getattr(step, "__wrapped__", None) is type(self.optimizer).step
        )

    def forget(self) -> None:
        """Drop the shadow and what it holds; the next local step builds a new one."""
        self._shadow, self._mirrored, self._locals = None, [], []

    def _build(self, objects: list[object]) -> None:
        optimizer = self.optimizer
        groups, self._locals = [], []
        for group in optimizer.param_groups:
            local = [p._local_tensor for p in group["params"]]
            self._locals.append(local)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": local})
        self._shadow = None  # the old one (and what it holds) goes before the new one is made
        shadow = type(optimizer)(groups, foreach=optimizer.defaults.get("foreach"))
        for group, local in zip(optimizer.param_groups, self._locals, strict=True):
            for p, lp in zip(group["params"], local, strict=True):
                state = optimizer.state[p]
                shadow.state[lp] = {"step": state["step"], "exp_avg": state["exp_avg"]._local_tensor,
                                    "exp_avg_sq": state["exp_avg_sq"]._local_tensor}  # fmt: skip
        self._shadow, self._mirrored = shadow, objects

    def step(self) -> None:
        objects = self._mirrorable()
        if objects is None:
            self.optimizer.step()
            self.counts["real"] += 1
            return
        if (
            self._shadow is None
            or len(objects) != len(self._mirrored)
            or any(a is not b for a, b in zip(objects, self._mirrored, strict=True))
        ):
            self._build(objects)
            self.counts["built"] += 1
        self.counts["local"] += 1
        shadow = self._shadow
        for group, shadow_group in zip(self.optimizer.param_groups, shadow.param_groups, strict=True):
            for name, value in group.items():  # the schedulers change lr on the real groups
                if name != "params":
                    shadow_group[name] = value
        try:
            for group, local in zip(self.optimizer.param_groups, self._locals, strict=True):
                for p, lp in zip(group["params"], local, strict=True):
                    lp.grad = None if p.grad is None else p.grad._local_tensor
            shadow.step()
        finally:
            for local in self._locals:
                for lp in local:
                    lp.grad = None
        # what the LR scheduler's wrapper of the real step would have set (it warns otherwise)
        self.optimizer._opt_called = True
