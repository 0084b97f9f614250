"""The role engine: every role of one plan on FSDP2-sharded models, with its optimizers and its EMA.

What is stored where is the storage layout's (`verl_dmd.runtime.layouts`), the LoRA
mechanics are `verl_dmd.runtime.lora`'s, sharding and compilation
`verl_dmd.runtime.sharding`'s, the EMA `verl_dmd.runtime.ema`'s, and the state's
names `verl_dmd.runtime.naming`'s. The engine puts them together and owns what is
left: the partition of every parameter into exactly one role (or the frozen base),
the two AdamW optimizers and schedulers, and the two pieces of role state, kept
apart on purpose:

- the *active* role: whose weights a forward uses (`use_role`);
- the *trainable* role: whose parameters require grad (`trainable`), fixed for
  a whole phase. Switching the active role never changes the trainable set,
  so a frozen forward between the student's forward and its backward cannot drop
  the student's gradients (TRAPS: PEFT switching between forward and backward).

Inside a phase (a trainable role is set) a switch reshards nothing: it flips no
parameter flag, so the frozen forwards between the trainable role's forward and
its backward reuse the gathered weights; outside a phase every switch reshards, so
sampling, checkpoints and the sharding guard see shards. Modules a phase computer
declares (`verl_dmd.phases.ExtraModule`, e.g. DMD2's GAN head) are built and
attached before sharding, sharded as their own units and trained by their owner's
optimizer; the engine knows nothing of any method.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from verl_dmd.phases import TRAINABLE_ROLES, ExtraModule, Role
from verl_dmd.plan import DistillationPlan
from verl_dmd.runtime import naming, sharding
from verl_dmd.runtime.ema import StudentEma
from verl_dmd.runtime.guard import ShardingGuard
from verl_dmd.runtime.layouts import layout_for
from verl_dmd.runtime.optim import LocalShardStep, build_adamw, build_scheduler
from verl_dmd.runtime.sharding import local_tensor

__all__ = ["GradientIsolationError", "RoleEngine", "local_tensor"]


class GradientIsolationError(RuntimeError):
    """A parameter outside the phase's role received a gradient."""


class RoleEngine:
    """Owns the models, the role partition, both optimizers and schedulers, and the EMA of one rank."""

    STORE_FROZEN_IN_COMPUTE_DTYPE = True
    """Store frozen weights in model.param_dtype (see `sharding.store_frozen_in_compute_dtype`)."""

    def __init__(
        self,
        plan: DistillationPlan,
        adapter,
        *,
        device: torch.device | str = "cpu",
        mesh=None,
        extra_modules: Sequence[ExtraModule] = (),
    ) -> None:
        self.plan = plan
        self.adapter = adapter
        self.device = torch.device(device)
        self.mesh = mesh if mesh is not None else sharding.device_mesh(plan, self.device)
        self.layout = layout_for(plan, adapter)
        self._active: Role | None = None
        self._trainable: Role | None = None
        self._modes: dict[str, bool] = {}  # model name -> the train/eval mode this engine last set
        self._fsdp_module_cache: list[FSDPModule] | None = None
        self._module_cache: dict[str, tuple[list[nn.Module], bool]] = {}  # model -> (modules, plain train)

        started = time.perf_counter()
        self.layout.seed()  # the same on every rank: random init (configs, LoRA factors) must agree
        self.models: dict[str, nn.Module] = self.layout.build_models()
        self.extra_modules = self._attach(extra_modules)
        if self.STORE_FROZEN_IN_COMPUTE_DTYPE:
            sharding.store_frozen_in_compute_dtype(
                self.models, plan.model, lambda model, name: self._role_of(model, name) is not None
            )
        built = time.perf_counter()
        for model_name, model in self.models.items():
            model.to(self.device)
            extras = [m for m in self.extra_modules.values() if any(m is x for x in model.children())]
            sharding.shard(
                model, plan.model, adapter.fsdp_units, mesh=self.mesh, device=self.device,
                offload=self.layout.cpu_offloaded(model_name), extra_units=extras,
                full_precision_inputs=getattr(adapter, "full_precision_inputs", ()),
            )  # fmt: skip
        if plan.model.compile:
            units = [unit for model in self.models.values() for unit in adapter.fsdp_units(model)]
            sharding.compile_units(units, plan.model.compile_backend)
        sharded = time.perf_counter()
        self.params: dict[Role, list[nn.Parameter]] = {}
        self.frozen_params: list[nn.Parameter] = []
        self.param_names: dict[int, str] = {}
        self._collect_parameters()
        self.guard = ShardingGuard(self.models, self.param_names)
        self.ema: StudentEma | None = self.layout.make_ema(self.params) if plan.ema.enabled else None
        self._finish_lazy_init()
        self.optimizers = {
            role: build_adamw(self.params[role], getattr(plan.optim, role.value)) for role in TRAINABLE_ROLES
        }
        self.schedulers = {
            role: build_scheduler(self.optimizers[role], getattr(plan.optim, role.value).scheduler)
            for role in TRAINABLE_ROLES
        }
        # optimizer_step runs AdamW on the local shards (bitwise the same; see LocalShardStep). False: the
        # optimizer's own step on the DTensors (kept for comparisons: scripts/check_sleep_training.py).
        self.local_optimizer_step = True
        self._local_steps = {role: LocalShardStep(self.optimizers[role]) for role in TRAINABLE_ROLES}
        self._apply_trainable()
        self._activate(None)
        self.init_seconds = {"model build": built - started, "placement and sharding": sharded - built,
                             "optimizers and the rest": time.perf_counter() - sharded}  # fmt: skip
        """Where this engine's construction went (seconds): the driver logs it with the workers' start."""

    # ------------------------------------------------------------------ building

    def _attach(self, extra_modules: Sequence[ExtraModule]) -> dict[str, nn.Module]:
        """Build each declared module from the model holding its owner's weights and attach it there."""
        attached: dict[str, nn.Module] = {}
        for extra in extra_modules:
            if extra.name in attached:
                raise ValueError(f"extra module {extra.name!r} is declared twice")
            holder = self.module_for(extra.owner)
            if hasattr(holder, extra.name):
                raise ValueError(
                    f"extra module {extra.name!r}: the model already has an attribute of that name"
                )
            module = extra.build(holder)
            holder.add_module(extra.name, module)
            attached[extra.name] = module
        self._extra_owners = {extra.name: extra.owner for extra in extra_modules}
        return attached

    def extra_module(self, name: str) -> nn.Module:
        """A module the phase computer declared (`ExtraModule`), by name."""
        try:
            return self.extra_modules[name]
        except KeyError:
            raise KeyError(
                f"no extra module {name!r}: the phase computer declared {sorted(self.extra_modules) or 'none'}"
            ) from None

    def _collect_parameters(self) -> None:
        """Partition every parameter into exactly one role (or the frozen base); assert it."""
        groups: dict[Role, list[nn.Parameter]] = {role: [] for role in (*TRAINABLE_ROLES, Role.STUDENT_EMA)}
        frozen: list[nn.Parameter] = []
        seen: set[int] = set()
        for model_name, model in self.models.items():
            for name, param in model.named_parameters():
                full = naming.full_name(model_name, name)
                if id(param) in seen:
                    raise AssertionError(f"parameter {full} is shared between roles")
                seen.add(id(param))
                self.param_names[id(param)] = full
                role = self._role_of(model_name, name)
                (groups[role] if role is not None else frozen).append(param)
        for role in TRAINABLE_ROLES:
            if not groups[role]:
                raise AssertionError(f"role {role.value} has no trainable parameters")
        self.params = groups
        self.frozen_params = frozen

    def _role_of(self, model_name: str, param_name: str) -> Role | None:
        for name, owner in self._extra_owners.items():
            if param_name.startswith(name + "."):
                return owner
        return self.layout.role_of(model_name, param_name)

    def _finish_lazy_init(self) -> None:
        """Run FSDP2's lazy init now, with both trainable roles marked trainable (TRAPS: gradient dtypes)."""
        self._trainable = None
        trainable = [p for role in TRAINABLE_ROLES for p in self.params[role]]
        sharding.finish_lazy_init(self.models.values(), trainable)
        # declared modules run in some micro-batches only (a GAN head per exit group): gathered once now, so a
        # micro-batch that skips one can still finish its backward without gradient sync
        sharding.gather_once(self.extra_modules.values())

    def verify_layout(self) -> None:
        """Fail closed if the models gained parameters after sharding or lost their sharding (every phase)."""
        self.guard.verify()

    # ------------------------------------------------------------------ roles

    def fsdp_modules(self) -> list[FSDPModule]:
        """Every FSDP2 module (units and roots) of every model, listed once (sharding happens at construction,
        and the walk costs milliseconds of host time at every reshard)."""
        if self._fsdp_module_cache is None:
            self._fsdp_module_cache = [
                m for model in self.models.values() for m in model.modules() if isinstance(m, FSDPModule)
            ]
        return list(self._fsdp_module_cache)

    def reshard(self) -> None:
        """Free every gathered parameter; required before flipping flags or swapping weights (TRAPS)."""
        for module in self.fsdp_modules():
            module.reshard()

    def module_for(self, role: Role) -> nn.Module:
        """The model that holds `role`'s weights."""
        return self.models[self.layout.model_name(Role(role))]

    @property
    def active_role(self) -> Role | None:
        return self._active

    @property
    def trainable_role(self) -> Role | None:
        return self._trainable

    @contextlib.contextmanager
    def use_role(self, role: Role | str) -> Iterator[nn.Module]:
        """Run forwards as `role`; restores the previous role and the trainable set on exit.

        Train/eval mode follows the role: only the trainable role in its own phase
        runs in train mode. Frozen roles should be called under ``torch.no_grad``.
        """
        role = Role(role)
        if role is Role.STUDENT_EMA and self.ema is None:
            raise ValueError("role student_ema does not exist: ema.enabled is false")
        previous = self._active
        self._activate(role)
        try:
            yield self.module_for(role)
        finally:
            self._activate(previous)

    def _activate(self, role: Role | None) -> None:
        """Make `role` the active one (see the module docstring for when a switch reshards)."""
        if self._trainable is None:
            self.reshard()
        self.layout.switch(self, role, self._active)
        self._active = role
        self._apply_modes()
        self._apply_trainable()

    def _apply_modes(self) -> None:
        """Train mode for the trainable role's model while that role is active, eval for every other.

        The engine remembers the mode it set per model (a root's `training` flag says nothing about
        submodules added later, e.g. PEFT's dropout layers, which start in train mode), and sets it
        again only when that changes.
        """
        active = self._active
        training = self.module_for(active) if active is not None and active is self._trainable else None
        for name, model in self.models.items():
            wanted = model is training
            if self._modes.get(name) != wanted:
                self._set_mode(name, model, wanted)
                self._modes[name] = wanted

    def _set_mode(self, name: str, model: nn.Module, mode: bool) -> None:
        """`model.train(mode)`, without walking the module tree each time when no module overrides `train`
        (the first switch of a phase runs while the GPU waits)."""
        if name not in self._module_cache:
            modules = list(model.modules())
            plain = all(type(m).train is nn.Module.train for m in modules)
            self._module_cache[name] = (modules, plain)
        modules, plain = self._module_cache[name]
        if not plain:
            model.train(mode)
            return
        for module in modules:
            module.__dict__["training"] = mode  # what nn.Module.train sets on each module

    @contextlib.contextmanager
    def trainable(self, role: Role | None) -> Iterator[None]:
        """Make `role`'s parameters (and only those) require grad for the duration of a phase."""
        if role is not None and not Role(role).trainable:
            raise ValueError(f"role {role} cannot train")
        previous = self._trainable
        self._trainable = None if role is None else Role(role)
        self.reshard()
        self._apply_modes()
        self._apply_trainable()
        try:
            yield
        finally:
            self._trainable = previous
            self.reshard()
            self._apply_modes()
            self._apply_trainable()

    def _apply_trainable(self) -> None:
        for role, params in self.params.items():
            flag = role is self._trainable
            for p in params:
                if p.requires_grad != flag:
                    p.requires_grad_(flag)
        for p in self.frozen_params:
            if p.requires_grad:
                p.requires_grad_(False)

    # ------------------------------------------------------------------ gradients and steps

    def optimizer_step(self, role: Role) -> None:
        """One AdamW step of `role` (on the local shards unless `local_optimizer_step` is False)."""
        if self.local_optimizer_step:
            step = self._local_steps[role]
            if step.optimizer is not self.optimizers[role]:  # the role's optimizer was replaced
                step = self._local_steps[role] = LocalShardStep(self.optimizers[role])
            step.step()
        else:
            self.optimizers[role].step()

    def forget_step_shadows(self) -> None:
        """Drop the local-shard optimizer shadows (rebuilt at the next step; see LocalShardStep.forget)."""
        for step in self._local_steps.values():
            step.forget()

    def zero_grad(self, role: Role) -> None:
        self.optimizers[role].zero_grad(set_to_none=True)

    def check_gradient_isolation(self, role: Role) -> None:
        """Fail closed if any parameter outside `role` holds a gradient."""
        own = set(map(id, self.params[role]))
        for params in (*self.params.values(), self.frozen_params):
            for p in params:
                if id(p) not in own and p.grad is not None:
                    raise GradientIsolationError(
                        f"gradient isolation broken in a {role.value} phase: parameter "
                        f"{self.param_names[id(p)]} (not a {role.value} parameter) holds a gradient; "
                        "a phase computer must run every other role under torch.no_grad"
                    )

    def set_gradient_sync(self, enabled: bool) -> None:
        for module in self.fsdp_modules():
            module.set_requires_gradient_sync(enabled, recurse=False)

    def update_ema(self, global_step: int) -> None:
        """After a successful student step: the EMA's update (a no-op without EMA)."""
        if self.ema is not None:
            self.ema.update(global_step)

    # ------------------------------------------------------------------ state

    def state_objects(self) -> list[torch.Tensor]:
        """Every tensor of this rank's state as the engine holds it (DTensors for sharded ones): every
        parameter, the EMA's own tensors, and both optimizers' state tensors (what sleep/wake moves)."""
        objects: list[torch.Tensor] = [p for params in self.params.values() for p in params]
        objects += list(self.frozen_params)
        objects += self.ema.own_tensors if self.ema is not None else []
        for optimizer in self.optimizers.values():
            for state in optimizer.state.values():
                objects += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return objects

    def prepare_to_sleep(self) -> None:
        """Reshard, drop every gradient and the optimizer shadows: what must precede moving the state away."""
        self.reshard()
        for role in self.optimizers:
            self.zero_grad(role)
        self.forget_step_shadows()  # a stale shadow could hold replaced state tensors on the device

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of local parameter shards on this rank: frozen (base/teacher) and per role."""

        def size(params):
            return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in params)

        out = {"frozen": size(self.frozen_params)}
        out.update({role.value: size(params) for role, params in self.params.items()})
        out["ema_state"] = size(self.ema.own_tensors if self.ema is not None else [])
        return out
