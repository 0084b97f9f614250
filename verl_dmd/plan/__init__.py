"""The distillation plan: the validated, immutable description of one training run.

`verl_dmd.plan.specs` holds every key (frozen dataclasses with their defaults,
docs and checks) and `DistillationPlan`; `verl_dmd.plan.schema` the generic
coercion they are built with. Import from here.

Layer 1: no torch, no distribution, no ray, no verl.
"""

from verl_dmd.plan.schema import PlanError, flatten
from verl_dmd.plan.specs import (
    ADDED_KEYS,
    FINGERPRINT_SCHEMA,
    LOCATION_KEYS,
    MODEL_SOURCES,
    RESUME_MUTABLE_KEYS,
    TRACKING_BACKENDS,
    AlgorithmSpec,
    BatchSpec,
    CheckpointSpec,
    DataSpec,
    DistillationPlan,
    EmaSpec,
    ExportSpec,
    LoraSpec,
    ModelSpec,
    OptimSpec,
    ResourceSpec,
    RoleBatchSpecs,
    RoleOptimSpecs,
    SchedulerSpec,
    TeacherSpec,
    TrainableModelSpec,
    TrainerSpec,
    ValidationSpec,
    _defaults_without_validation,
    fingerprint_of,
    plan_keys,
)

__all__ = [
    "ADDED_KEYS",
    "FINGERPRINT_SCHEMA",
    "LOCATION_KEYS",
    "MODEL_SOURCES",
    "RESUME_MUTABLE_KEYS",
    "TRACKING_BACKENDS",
    "AlgorithmSpec",
    "BatchSpec",
    "CheckpointSpec",
    "DataSpec",
    "DistillationPlan",
    "EmaSpec",
    "ExportSpec",
    "LoraSpec",
    "ModelSpec",
    "OptimSpec",
    "PlanError",
    "ResourceSpec",
    "RoleBatchSpecs",
    "RoleOptimSpecs",
    "SchedulerSpec",
    "TeacherSpec",
    "TrainableModelSpec",
    "TrainerSpec",
    "ValidationSpec",
    "_defaults_without_validation",
    "fingerprint_of",
    "flatten",
    "plan_keys",
]
