"""The role engine: one physical model group holding every role, sharded with FSDP2.

Two layouts (`model.storage`):

- ``shared_base_adapters``: one frozen base with the LoRA adapters ``student``,
  ``fake_score`` and (with EMA) ``student_ema``; the teacher is the base with
  adapters disabled. Every adapter is added before `fully_shard` (TRAPS: an
  adapter added later is a replicated parameter whose gradients never sync).
- ``independent``: a frozen teacher plus separate student and fake-score models
  (each optionally LoRA-adapted); the student's EMA is kept as per-parameter
  state next to its shards.

Two pieces of state are kept apart on purpose:
- the *active* role: whose weights a forward uses (`use_role`);
- the *trainable* role: whose parameters require grad (`trainable`), fixed for
  a whole phase. Switching the active role never changes the trainable set,
  so a frozen forward between the student's forward and its backward cannot drop
  the student's gradients (TRAPS: PEFT switching between forward and backward).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verl_dmd.adapters.base import DistributionMatchingModelAdapter, ModelSource
from verl_dmd.phases import TRAINABLE_ROLES, Role
from verl_dmd.plan import DistillationPlan, LoraSpec
from verl_dmd.runtime.optim import LocalShardStep, build_adamw, build_scheduler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LORA_CONTAINERS = ("lora_A", "lora_B")


class GradientIsolationError(RuntimeError):
    """A parameter outside the phase's role received a gradient."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (or the tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


GAN_HEAD = "dmd_gan_head"
"""Submodule name of the GAN head on the model that holds the fake score."""


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


def canonical_name(param_name: str) -> str:
    """A parameter's name without the segments that activation-checkpoint wrappers insert.

    Checkpoint keys use these names, so a checkpoint saved with activation checkpointing on
    loads with it off and vice versa (the key is resume-mutable).
    """
    for prefix in _WRAPPER_PREFIXES:
        param_name = param_name.replace(prefix, "")
    return param_name


def _adapter_of(param_name: str) -> str | None:
    """The LoRA adapter a parameter belongs to (`...lora_A.<adapter>.weight`), else None."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _LORA_CONTAINERS:
            return parts[i + 1]
    return None


def _lora_config(spec: LoraSpec, default_targets: Sequence[str]):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha if spec.alpha is not None else spec.rank,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules or default_targets),
        init_lora_weights=True,
    )


def _add_adapter(model: nn.Module, config, name: str) -> None:
    """Inject a named LoRA adapter with PEFT itself, so any nn.Module works (not only diffusers
    models with the PEFT mixin); every adapter is added before sharding (see the module docstring)."""
    import warnings

    from peft import inject_adapter_in_model

    with warnings.catch_warnings():
        # PEFT warns that a second adapter joins an existing peft_config: that is the point here.
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(config, model, adapter_name=name)


def load_peft_adapter_dir(model: nn.Module, path: str, adapter_name: str, spec: LoraSpec, key: str) -> None:
    """Load a saved PEFT adapter directory into `adapter_name` (before sharding).

    Rank and alpha must match the plan's, since the plan defines the shapes and
    the scale; a mismatch is a one-line error naming the key.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(
                f"config key '{key}.init_path' = {path!r}: {needed.name} not found; "
                "fix: point it at a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)"
            )
    saved = json.loads(config_file.read_text())
    want_alpha = spec.alpha if spec.alpha is not None else float(spec.rank)
    if saved.get("r") != spec.rank or float(saved.get("lora_alpha", -1)) != float(want_alpha):
        raise ValueError(
            f"config key '{key}.init_path' = {path!r}: the adapter has rank {saved.get('r')} and alpha "
            f"{saved.get('lora_alpha')} but {key}.rank = {spec.rank} and alpha = {want_alpha}; "
            "fix: set the plan's rank and alpha to the adapter's"
        )
    state = load_file(str(weights_file))
    # PeftModel.save_pretrained (and verl-dmd-export) prefix keys with its wrappers' names.
    prefix = "base_model.model."
    state = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(
            f"config key '{key}.init_path' = {path!r}: {len(unexpected)} adapter weights match no module "
            f"(first: {unexpected[0]}); fix: use an adapter trained for this model and target_modules"
        )


class RoleEngine:
    """Owns the models, the LoRA adapters, both optimizers and schedulers, and the EMA."""

    def __init__(
        self,
        plan: DistillationPlan,
        adapter: DistributionMatchingModelAdapter,
        *,
        device: torch.device | str = "cpu",
        mesh=None,
    ) -> None:
        self.plan = plan
        self.adapter = adapter
        self.device = torch.device(device)
        self.mesh = mesh
        self.layout = plan.model.storage
        self.ema_enabled = plan.ema.enabled
        self._active: Role | None = None
        self._trainable: Role | None = None
        self._modes: dict[str, bool] = {}  # model name -> the train/eval mode this engine last set
        self._tuner_layer_cache: list[nn.Module] | None = None
        self._fsdp_module_cache: list[FSDPModule] | None = None
        # verify_layout's kept tree: roots, modules, their ids, the number of child links among them
        self._layout_known: tuple[list[nn.Module], list[nn.Module], set[int], int] | None = None
        self._module_cache: dict[
            str, tuple[list[nn.Module], bool]
        ] = {}  # model name -> (modules, plain train)

        # Same seed on every rank: random init (configs, LoRA A matrices) must agree.
        torch.manual_seed(plan.trainer.seed)
        if self.layout == "shared_base_adapters":
            self.models: dict[str, nn.Module] = {"base": self._build_shared()}
        else:
            self.models = self._build_independent()
        # DMD2's GAN head: a fake-score parameter group on the model holding the fake score,
        # sharded as its own unit so it can be called outside that model's forward.
        self.gan_head: nn.Module | None = None
        if plan.algorithm.gan_discriminator_weight > 0:
            from verl_dmd.algorithms.dmd2 import GanHead

            holder = self.module_for(Role.FAKE_SCORE)
            self.gan_head = GanHead(self.adapter.gan_feature_dim(holder))
            holder.add_module(GAN_HEAD, self.gan_head)
        self._store_frozen_in_compute_dtype()
        for model in self.models.values():
            model.to(self.device)
            self._shard(
                model, offload=model is self.models.get("teacher") or self.layout == "shared_base_adapters"
            )
        if plan.model.compile:
            self._compile_units()
        self.params: dict[Role, list[nn.Parameter]] = {}
        self.param_names: dict[int, str] = {}
        self._collect_parameters()
        # Independent layout: EMA as per-parameter state with the parameters' sharding (DTensors),
        # so checkpoints save and reshard it like the parameters themselves.
        self.independent_ema: list[torch.Tensor] = []
        if self.ema_enabled and self.layout == "independent":
            self.independent_ema = [p.detach().clone() for p in self.params[Role.STUDENT]]
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

    # ------------------------------------------------------------------ building

    def _build_shared(self) -> nn.Module:
        base = self.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        base.requires_grad_(False)
        names = [Role.STUDENT, Role.FAKE_SCORE] + ([Role.STUDENT_EMA] if self.ema_enabled else [])
        for role in names:
            spec = self._lora_spec(role)
            _add_adapter(base, _lora_config(spec, self.adapter.default_lora_targets), role.value)
            if spec.init_path and role is not Role.STUDENT_EMA:
                load_peft_adapter_dir(base, spec.init_path, role.value, spec, f"model.{role.value}.lora")
        if self.ema_enabled:
            self._copy_adapter(base, Role.STUDENT.value, Role.STUDENT_EMA.value)
        return base

    def _build_independent(self) -> dict[str, nn.Module]:
        teacher = self.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        teacher.requires_grad_(False)
        models = {"teacher": teacher}
        for role in TRAINABLE_ROLES:
            spec = getattr(self.plan.model, role.value)
            source = ModelSource.of(spec)
            model = copy.deepcopy(teacher) if source.is_empty else self.adapter.build_model(source)
            if spec.lora.enabled:
                model.requires_grad_(False)
                _add_adapter(model, _lora_config(spec.lora, self.adapter.default_lora_targets), role.value)
                if spec.lora.init_path:
                    load_peft_adapter_dir(
                        model, spec.lora.init_path, role.value, spec.lora, f"model.{role.value}.lora"
                    )
            else:
                model.requires_grad_(True)
            models[role.value] = model
        return models

    def _lora_spec(self, role: Role) -> LoraSpec:
        owner = Role.STUDENT if role is Role.STUDENT_EMA else role
        return getattr(self.plan.model, owner.value).lora

    @staticmethod
    def _copy_adapter(model: nn.Module, source: str, target: str) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                if _adapter_of(name) == source:
                    params[name.replace(f".{source}.", f".{target}.")].copy_(param)

    STORE_FROZEN_IN_COMPUTE_DTYPE = True

    def _store_frozen_in_compute_dtype(self) -> None:
        """With low-precision compute (model.param_dtype), keep frozen weights in that dtype.

        FSDP2 casts every parameter to param_dtype at each all-gather, so a frozen weight stored in
        float32 only ever enters compute as its bfloat16 rounding: storing that rounding once gives
        the same forwards bit for bit, with half the memory, half the sleep/wake bytes, and no cast
        kernels per parameter at each gather (thousands per DMD2 cycle for SD3). Trainable weights
        (every role's parameters, the GAN head) keep their float32 master copies.
        """
        dtype = _DTYPES[self.plan.model.param_dtype]
        if dtype is torch.float32 or not self.STORE_FROZEN_IN_COMPUTE_DTYPE:
            return
        with torch.no_grad():
            for model_name, model in self.models.items():
                for name, param in model.named_parameters():
                    if self._role_of(model_name, name) is None and param.is_floating_point():
                        param.data = param.data.to(dtype)

    def _shard(self, model: nn.Module, *, offload: bool) -> None:
        param_dtype = _DTYPES[self.plan.model.param_dtype]
        reduce_dtype = _DTYPES[self.plan.model.reduce_dtype]
        # Without low-precision parameters, "reduce in float32" means "reduce in the parameters'
        # own dtype": forcing float32 would round float64 gradients (seen in the float64 tests).
        mixed = param_dtype is not torch.float32
        mp_policy = MixedPrecisionPolicy(
            param_dtype=param_dtype if mixed else None,
            reduce_dtype=None if not mixed and reduce_dtype is torch.float32 else reduce_dtype,
        )
        kwargs = {"mesh": self.mesh, "mp_policy": mp_policy}
        if not self.plan.model.reshard_after_forward:
            # Keep gathered weights after forward; the engine reshards every unit itself when a phase
            # ends and at role switches outside phases. Otherwise FSDP2's default: non-root units reshard
            # after forward, the root keeps its weights until backward (passing True would reshard the
            # root too, and an autograd.grad through it after its forward then fails: TRAPS-like, seen
            # in the GAN generator term).
            kwargs["reshard_after_forward"] = False
        if offload and self.plan.model.teacher.cpu_offload:
            # pin_memory needs an accelerator (TRAPS: CPUOffloadPolicy on CPU).
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        if self.plan.model.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            units = set(map(id, self.adapter.fsdp_units(model)))
            apply_activation_checkpointing(model, check_fn=lambda m: id(m) in units)
        units = list(self.adapter.fsdp_units(model)) if self.plan.model.fsdp_units == "blocks" else []
        if hasattr(model, GAN_HEAD):
            units.append(getattr(model, GAN_HEAD))
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)

    # Guard variants one block's compiled forward needs: roles (adapters on/off, which adapter),
    # grad mode, train/eval, the blocks that differ (e.g. SD3's last, context_pre_only): 15 were seen
    # for SD3 with EMA. torch's default of 8 would make the rest run eagerly, silently.
    COMPILE_CACHE_SIZE = 64

    def _compile_units(self) -> None:
        """torch.compile the forward of every FSDP2 unit the adapter lists (model.compile).

        Only the unit's own `forward` is compiled (an instance attribute over the class's): FSDP2's
        hooks and activation-checkpoint wrappers stay outside the graph. Blocks of one class share
        their code, so one compilation per guard variant serves all of them; a role switch (PEFT's
        active adapter, adapters disabled, requires_grad) is a guard, so a stale graph cannot run.
        """
        from torch._dynamo import config as dynamo_config

        if dynamo_config.cache_size_limit < self.COMPILE_CACHE_SIZE:
            logger.info(
                "model.compile: raising torch._dynamo.config.cache_size_limit from %d to %d (process-wide)",
                dynamo_config.cache_size_limit,
                self.COMPILE_CACHE_SIZE,
            )
            dynamo_config.cache_size_limit = self.COMPILE_CACHE_SIZE
        # After this, never deepcopy a model: the copy's `forward` would still be the compiled function
        # bound to the original module (the independent layout copies models before sharding, above).
        backend = self.plan.model.compile_backend
        for model in self.models.values():
            for unit in self.adapter.fsdp_units(model):
                inner = getattr(unit, "_checkpoint_wrapped_module", unit)
                inner.forward = torch.compile(inner.forward, backend=backend)

    def _collect_parameters(self) -> None:
        """Partition every parameter into exactly one role (or the frozen base); assert it."""
        groups: dict[Role, list[nn.Parameter]] = {role: [] for role in (*TRAINABLE_ROLES, Role.STUDENT_EMA)}
        frozen: list[nn.Parameter] = []
        seen: set[int] = set()
        for model_name, model in self.models.items():
            for name, param in model.named_parameters():
                full = f"{model_name}.{canonical_name(name)}"
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
        if param_name.startswith(GAN_HEAD + "."):
            return Role.FAKE_SCORE
        adapter = _adapter_of(param_name)
        if self.layout == "shared_base_adapters":
            return Role(adapter) if adapter is not None else None
        if model_name == "teacher":
            return None
        role = Role(model_name)
        lora = getattr(self.plan.model, model_name).lora
        if lora.enabled:
            return role if adapter == model_name else None
        return role

    def _finish_lazy_init(self) -> None:
        """Run FSDP2's lazy init now, with both trainable roles marked trainable.

        FSDP2 fixes each group's gradient dtype at the first forward from the
        parameters requiring grad then; a first forward by a frozen role would
        leave low-precision gradients meeting fp32 shards later (TRAPS).
        """
        self._trainable = None
        for role in TRAINABLE_ROLES:
            for p in self.params[role]:
                p.requires_grad_(True)
        for model in self.models.values():
            model._get_fsdp_state()._lazy_init()
        for role in TRAINABLE_ROLES:
            for p in self.params[role]:
                p.requires_grad_(False)

    def verify_layout(self) -> None:
        """Fail closed if the models gained parameters after sharding or lost their sharding.

        An adapter added after `fully_shard` is a plain replicated parameter whose
        gradients are never synchronized: ranks silently diverge (TRAPS).

        Runs at every phase. Walking `named_parameters` costs ~3 ms of host time for the SD3 shape
        (2,400 modules), and the GPU idles meanwhile at a phase start; so after a full walk has
        passed, the modules it saw are kept, and later calls check only that no kept module has a
        child module or a parameter that was not there (any new parameter reachable from a model
        hangs below such a child or is such a parameter). Anything new sends the call back to the
        full walk, which raises with the parameter's name, or passes and keeps the new tree; so does a
        model that is not the one the walk saw, and a child module removed (the count of child links
        drops: the kept list must not hold the removed module's parameters on the device).
        """
        roots = list(self.models.values())
        known = self._layout_known
        if (
            known is not None
            and len(roots) == len(known[0])
            and all(a is b for a, b in zip(roots, known[0], strict=True))
            and self._layout_unchanged(known[1], known[2]) == known[3]
        ):
            return
        self._verify_layout_walk()
        modules = [m for model in roots for m in model.modules()]
        module_ids = {id(m) for m in modules}
        links = self._layout_unchanged(modules, module_ids)
        self._layout_known = (roots, modules, module_ids, links)  # the lists keep the ids from reuse

    def _layout_unchanged(self, modules: list[nn.Module], module_ids: set[int]) -> int:
        """The number of child links among `modules`; -1 when one has a new child or a new parameter."""
        names, sharded = self.param_names, dist.is_initialized()
        links = 0
        for module in modules:  # plain loops: this runs at every phase
            for child in module._modules.values():
                if child is not None:
                    if id(child) not in module_ids:
                        return -1
                    links += 1
            for param in module._parameters.values():
                if param is not None and (
                    id(param) not in names or (sharded and not isinstance(param, DTensor))
                ):
                    return -1
        return links

    def _verify_layout_walk(self) -> None:
        sharded = dist.is_initialized()
        for model_name, model in self.models.items():
            for name, param in model.named_parameters():
                full = f"{model_name}.{name}"
                if id(param) not in self.param_names:
                    raise RuntimeError(
                        f"parameter {full} appeared after the engine sharded the model; "
                        "add every adapter before fully_shard (RoleEngine does this at construction)"
                    )
                if sharded and not isinstance(param, DTensor):
                    raise RuntimeError(
                        f"parameter {full} is not sharded (not a DTensor); it would never sync"
                    )

    # ------------------------------------------------------------------ roles

    def fsdp_modules(self) -> list[FSDPModule]:
        """Every FSDP2 module (units and roots) of every model (listed once: sharding happens at construction,
        and walking ~2,000 modules costs ~2 ms of host time at every reshard)."""
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
        if self.layout == "shared_base_adapters":
            return self.models["base"]
        return self.models[Role.STUDENT.value if role is Role.STUDENT_EMA else role.value]

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
        if role is Role.STUDENT_EMA and not self.ema_enabled:
            raise ValueError("role student_ema does not exist: ema.enabled is false")
        previous = self._active
        self._activate(role)
        try:
            yield self.module_for(role)
        finally:
            self._activate(previous)

    def _activate(self, role: Role | None) -> None:
        """Make `role` the active one.

        Inside a phase (a trainable role is set) gathered weights stay gathered: a switch flips no
        parameter flag (the trainable set is fixed for the phase), so the frozen forwards between the
        trainable role's forward and its backward re-gather nothing; only the EMA swap rewrites shards.
        Outside a phase every switch reshards, so sampling, checkpoints and `verify_layout` see shards.
        """
        if self._trainable is None:
            self.reshard()
        if self.layout == "shared_base_adapters":
            self._switch_adapter(role)
        elif role is not self._active and Role.STUDENT_EMA in (role, self._active):
            self.reshard()  # the swap rewrites the student's shards: gathered copies would be stale
            self._swap_ema()
        self._active = role
        self._apply_modes()
        self._apply_trainable()

    def _apply_modes(self) -> None:
        """Train mode for the trainable role's model while that role is active, eval for every other.

        The engine remembers the mode it set per model (a root's `training` flag says nothing about
        submodules added later, e.g. PEFT's dropout layers, which start in train mode), and calls
        `train()`, which walks every submodule, only when that changes.
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
        (the walk costs several ms of host time per switch for an SD3-sized model with LoRA, and the
        first switch of a phase runs while the GPU waits)."""
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

    def _switch_adapter(self, role: Role | None) -> None:
        """Point every LoRA layer at `role`'s adapter (the teacher: adapters off), touching no parameter.

        PEFT's `set_adapter` / `enable_adapters` also set `requires_grad` on the adapter weights, and
        on gathered FSDP2 copies those flags are lost at the next reshard (TRAPS), which forced a
        reshard (and a re-gather of every unit) at each switch. The two attributes they read in
        forward are set directly instead; `_apply_trainable` alone owns `requires_grad`.
        """
        from peft.tuners.tuners_utils import BaseTunerLayer

        disabled = role is Role.TEACHER
        active = [Role.STUDENT.value if role is None or disabled else role.value]
        for module in self._tuner_layers(BaseTunerLayer):
            # Plain attributes: written to the instance dict, what nn.Module.__setattr__ does for them
            # after its checks (~5 us per write, ~1 ms per switch for the SD3 shape's 96 LoRA layers).
            state = module.__dict__
            state["_disable_adapters"] = disabled
            state["_active_adapter"] = list(active)  # a list per layer, as set_adapter leaves it

    def _tuner_layers(self, kind) -> list[nn.Module]:
        if self._tuner_layer_cache is None:
            self._tuner_layer_cache = [m for m in self.models["base"].modules() if isinstance(m, kind)]
        return self._tuner_layer_cache

    def _swap_ema(self) -> None:
        """Exchange the student's shards with the EMA shards in place (independent layout)."""
        with torch.no_grad():
            for param, ema in zip(self.params[Role.STUDENT], self.independent_ema, strict=True):
                shard, ema_shard = local_tensor(param), local_tensor(ema)
                scratch = shard.clone()
                shard.copy_(ema_shard)
                ema_shard.copy_(scratch)

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

    # ------------------------------------------------------------------ gradients

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

    # ------------------------------------------------------------------ EMA

    def update_ema(self, global_step: int) -> None:
        """After a successful student step: EMA <- lerp(student), or a copy before ema.start_step."""
        if not self.ema_enabled:
            return
        weight = 1.0 if global_step < self.plan.ema.start_step else 1.0 - self.plan.ema.decay
        if self.layout == "shared_base_adapters":
            targets = [local_tensor(p) for p in self.params[Role.STUDENT_EMA]]
        else:
            targets = [local_tensor(t) for t in self.independent_ema]
        with torch.no_grad():
            for target, student in zip(targets, self.params[Role.STUDENT], strict=True):
                target.lerp_(local_tensor(student), weight)

    # ------------------------------------------------------------------ memory

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of local parameter shards on this rank: frozen (base/teacher) and per role."""

        def size(params):
            return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in params)

        out = {"frozen": size(self.frozen_params)}
        out.update({role.value: size(params) for role, params in self.params.items()})
        out["ema_state"] = size(self.independent_ema)
        return out
