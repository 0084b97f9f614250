"""The two storage layouts of the roles (`model.storage`), one class each behind one interface.

- `SharedBaseLayout` (``shared_base_adapters``): one frozen base, the model ``base``,
  with the LoRA adapters ``student``, ``fake_score`` and (with EMA) ``student_ema``;
  the teacher is the base with adapters off. Every adapter is added before
  sharding (TRAPS: an adapter added later is a replicated parameter whose gradients
  never sync); ``student_ema`` starts as a copy of ``student``. A role switch points
  every LoRA layer at the role's adapter (`verl_dmd.runtime.lora.switch_adapter`).
- `IndependentLayout` (``independent``): a frozen ``teacher`` plus separate
  ``student`` and ``fake_score`` models built from their own source or copied from
  the teacher, each optionally LoRA-adapted; the student's EMA holds its own tensors,
  swapped into the student's shards to sample as ``student_ema``.

A layout decides what is built, which model holds a role, which role owns a
parameter, what a switch does, where the EMA lives, and where a role's weights are
among the state keys (`verl_dmd.runtime.naming`); the role engine does the rest the
same way for both.
"""

from __future__ import annotations

import copy
from typing import ClassVar

from torch import nn

from verl_dmd import seeding
from verl_dmd.adapters.base import ModelSource
from verl_dmd.phases import TRAINABLE_ROLES, Role
from verl_dmd.plan import DistillationPlan, LoraSpec
from verl_dmd.runtime import lora
from verl_dmd.runtime.ema import StudentEma
from verl_dmd.runtime.naming import BASE, EMA, PARAM, TEACHER, RoleTensors


class StorageLayout:
    """How the roles of one plan are stored; `layout_for(plan, adapter)` picks the class."""

    name: ClassVar[str]

    def __init__(self, plan: DistillationPlan, adapter) -> None:
        self.plan = plan
        self.adapter = adapter
        self.ema_enabled = plan.ema.enabled

    # ---- building
    def seed(self) -> None:
        """Seed torch's global RNG, which building draws from (random init of configs, LoRA factors), alike on
        every rank and in export (which rebuilds a config-built base the same way)."""
        seeding.seed_models(self.plan.trainer.seed)

    def build_models(self) -> dict[str, nn.Module]:
        """Every model of the layout by name, unsharded, trainable flags set (after `seed`)."""
        raise NotImplementedError

    def build_role_model(self, role: Role) -> nn.Module:
        """One process, no sharding: the model `role`'s saved weights go into, before its LoRA adapter is added
        (`add_role_adapter`); built as `build_models` builds it (same sources, same order of random draws)."""
        raise NotImplementedError

    def add_role_adapter(self, model: nn.Module, role: Role) -> None:
        """Inject `role`'s LoRA adapter (under the name its state keys use) into a `build_role_model` model."""
        selection = self.role_tensors(role)
        if selection.adapter is not None:
            config = lora.lora_config(self.plan.model.student.lora, self.adapter.default_lora_targets)
            lora.add_adapter(model, config, selection.adapter)

    def cpu_offloaded(self, model_name: str) -> bool:
        """Whether `model.teacher.cpu_offload` applies to this model (it holds frozen teacher weights)."""
        raise NotImplementedError

    def student_base(self) -> tuple[str | None, str | None]:
        """The model directory the student's LoRA adapter applies to, and a note when there is none."""
        return self.plan.model.teacher.path, None

    # ---- roles
    def model_name(self, role: Role) -> str:
        """The name of the model that holds `role`'s weights."""
        raise NotImplementedError

    def role_of(self, model_name: str, param_name: str) -> Role | None:
        """The role whose parameter this is, or None for a frozen (teacher / base) weight."""
        raise NotImplementedError

    def switch(self, engine, role: Role | None, previous: Role | None) -> None:
        """What making `role` the active one does to the models (the engine has resharded if it must)."""
        raise NotImplementedError

    def make_ema(self, params: dict[Role, list[nn.Parameter]]) -> StudentEma:
        raise NotImplementedError

    def role_tensors(self, role: Role) -> RoleTensors:
        """Where `role`'s weights are among the state keys (student or student_ema: what export reads)."""
        raise NotImplementedError


class SharedBaseLayout(StorageLayout):
    name = "shared_base_adapters"

    def __init__(self, plan: DistillationPlan, adapter) -> None:
        super().__init__(plan, adapter)
        self._tuner_layers: list[nn.Module] | None = None
        self._base: nn.Module | None = None

    def lora_spec(self, role: Role) -> LoraSpec:
        """A role's adapter settings (the EMA's are the student's)."""
        owner = Role.STUDENT if role is Role.STUDENT_EMA else role
        return getattr(self.plan.model, owner.value).lora

    def _base_model(self) -> nn.Module:
        base = self.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        base.requires_grad_(False)
        return base

    def build_models(self) -> dict[str, nn.Module]:
        base = self._base_model()
        roles = [*TRAINABLE_ROLES, *([Role.STUDENT_EMA] if self.ema_enabled else [])]
        for role in roles:
            spec = self.lora_spec(role)
            lora.add_adapter(base, lora.lora_config(spec, self.adapter.default_lora_targets), role.value)
            if spec.init_path and role is not Role.STUDENT_EMA:
                lora.load_peft_adapter_dir(base, spec.init_path, role.value, spec, f"model.{role.value}.lora")
        if self.ema_enabled:
            lora.copy_adapter(base, Role.STUDENT.value, Role.STUDENT_EMA.value)
        self._base = base
        return {BASE: base}

    def build_role_model(self, role: Role) -> nn.Module:
        return self._base_model()

    def cpu_offloaded(self, model_name: str) -> bool:
        return True

    def model_name(self, role: Role) -> str:
        return BASE

    def role_of(self, model_name: str, param_name: str) -> Role | None:
        adapter = lora.adapter_of(param_name)
        return Role(adapter) if adapter is not None else None

    def tuner_layers(self) -> list[nn.Module]:
        """The base's LoRA layers, listed once (sharding happens before the first switch)."""
        if self._tuner_layers is None:
            self._tuner_layers = lora.tuner_layers(self._base)
        return self._tuner_layers

    def switch(self, engine, role: Role | None, previous: Role | None) -> None:
        self.switch_adapter(role)

    def switch_adapter(self, role: Role | None) -> None:
        """Point every LoRA layer at `role`'s adapter (the teacher: adapters off; no role: the student's)."""
        teacher = role is Role.TEACHER
        active = Role.STUDENT.value if role is None or teacher else role.value
        lora.switch_adapter(self.tuner_layers(), active, enabled=not teacher)

    def make_ema(self, params: dict[Role, list[nn.Parameter]]) -> StudentEma:
        return StudentEma(self.plan.ema, params[Role.STUDENT], targets=params[Role.STUDENT_EMA])

    def role_tensors(self, role: Role) -> RoleTensors:
        return RoleTensors(prefix=f"{PARAM}{BASE}.", adapter=Role(role).value, model_name=BASE)


class IndependentLayout(StorageLayout):
    name = "independent"

    def _teacher(self) -> nn.Module:
        teacher = self.adapter.build_model(ModelSource.of(self.plan.model.teacher))
        teacher.requires_grad_(False)
        return teacher

    def build_models(self) -> dict[str, nn.Module]:
        teacher = self._teacher()
        models = {TEACHER: teacher}
        for role in TRAINABLE_ROLES:
            spec = getattr(self.plan.model, role.value)
            source = ModelSource.of(spec)
            model = copy.deepcopy(teacher) if source.is_empty else self.adapter.build_model(source)
            if spec.lora.enabled:
                model.requires_grad_(False)
                lora.add_adapter(
                    model, lora.lora_config(spec.lora, self.adapter.default_lora_targets), role.value
                )
                if spec.lora.init_path:
                    lora.load_peft_adapter_dir(
                        model, spec.lora.init_path, role.value, spec.lora, f"model.{role.value}.lora"
                    )
            else:
                model.requires_grad_(True)
            models[role.value] = model
        return models

    def build_role_model(self, role: Role) -> nn.Module:
        model = self._teacher()  # built first, as in build_models: a config-built student's draws follow it
        source = ModelSource.of(self.plan.model.student)
        return model if source.is_empty else self.adapter.build_model(source)

    def cpu_offloaded(self, model_name: str) -> bool:
        return model_name == TEACHER

    def student_base(self) -> tuple[str | None, str | None]:
        student = self.plan.model.student
        if student.path:
            return student.path, None
        if student.config is not None:  # a config-built base: no directory to name
            return None, (
                "the student's base was built from model.student.config, not the teacher; load the adapter onto "
                "that model"
            )
        return self.plan.model.teacher.path, None

    def model_name(self, role: Role) -> str:
        return Role.STUDENT.value if role is Role.STUDENT_EMA else Role(role).value

    def role_of(self, model_name: str, param_name: str) -> Role | None:
        if model_name == TEACHER:
            return None
        role = Role(model_name)
        if getattr(self.plan.model, model_name).lora.enabled:
            return role if lora.adapter_of(param_name) == model_name else None
        return role

    def switch(self, engine, role: Role | None, previous: Role | None) -> None:
        if role is not previous and Role.STUDENT_EMA in (role, previous):
            engine.reshard()  # the swap rewrites the student's shards: gathered copies would be stale
            engine.ema.swap()

    def make_ema(self, params: dict[Role, list[nn.Parameter]]) -> StudentEma:
        return StudentEma(self.plan.ema, params[Role.STUDENT])

    def role_tensors(self, role: Role) -> RoleTensors:
        student = Role.STUDENT.value
        prefix = f"{EMA}{student}." if role is Role.STUDENT_EMA else f"{PARAM}{student}."
        adapter = student if self.plan.model.student.lora.enabled else None
        return RoleTensors(prefix=prefix, adapter=adapter, model_name=student)


LAYOUTS: dict[str, type[StorageLayout]] = {cls.name: cls for cls in (SharedBaseLayout, IndependentLayout)}


def layout_for(plan: DistillationPlan, adapter) -> StorageLayout:
    """The layout `model.storage` names, for this plan and model adapter."""
    return LAYOUTS[plan.model.storage](plan, adapter)
