"""The driver's two extension points: data providers (`data.name`) and validators (`validation.name`).

A data provider is a class registered with ``@register_data_provider("<name>")``:
``from_plan(plan, group, info, log)`` builds it on the driver (it may ask the worker
group to sample, as digits does for its teacher pairs); ``next_batch(size)`` returns
the next global batch; ``state_dict()`` / ``load_state_dict()`` hold its position
(plain numbers: it is checkpointed); its class attribute ``validator`` names the
validator that suits its data (None: none), used while ``validation.name`` is empty.
A provider or validator may also have a classmethod ``preflight(plan)``: the driver's
pre-flight (`verl_dmd.preflight`) calls it before ray or any worker starts, and a
ValueError it raises is the run's one-line error (the embeddings provider checks its
files there).

A validator is a class registered with ``@register_validator("<name>")``:
``from_plan(plan, group, info)`` builds it (raising `ValidatorUnavailable` when it
cannot serve this run and was not asked for by name: the run then goes without
validation, saying why); ``run(out_dir, global_step)`` samples through the worker
group, writes what people look at (under `out_dir`, or where it documents) and
returns a `ValidationReport`. Packages add their own through the ``verl_dmd.data_providers``
and ``verl_dmd.validators`` entry-point groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_dmd.registry import Registry

_BUILTINS = ("verl_dmd.trainer.digits", "verl_dmd.trainer.embeddings", "verl_dmd.trainer.pipeline_validation")


def _has_from_plan(kind: str) -> Callable[[str, object], None]:
    def check(name: str, entry: object) -> None:
        if not (isinstance(entry, type) and callable(getattr(entry, "from_plan", None))):
            raise TypeError(f"@register_{kind}({name!r}) needs a class with a classmethod from_plan")

    return check


DATA_PROVIDERS: Registry[type] = Registry(
    "data provider",
    key="data.name",
    entry_point_group="verl_dmd.data_providers",
    builtin_modules=_BUILTINS,
    builtin_names=("digits", "embeddings"),
    check=_has_from_plan("data_provider"),
)
VALIDATORS: Registry[type] = Registry(
    "validator",
    key="validation.name",
    entry_point_group="verl_dmd.validators",
    builtin_modules=_BUILTINS,
    builtin_names=("digits", "pipeline"),
    check=_has_from_plan("validator"),
)


def register_data_provider(name: str):
    """Class decorator: make a data provider available as ``data.name=<name>``."""
    return DATA_PROVIDERS.register(name)


def register_validator(name: str):
    """Class decorator: make a validator available as ``validation.name=<name>``."""
    return VALIDATORS.register(name)


def validator_name(plan) -> str | None:
    """The validator a run uses: validation.name, else the data provider's own (None: no validation)."""
    if plan.validation.name:
        return plan.validation.name
    return getattr(DATA_PROVIDERS.get(plan.data.name), "validator", None)


class ValidatorUnavailable(Exception):
    """Raised by a validator's from_plan when the run's data or model gives it nothing to sample (the message
    says why); only when the validator was not named in validation.name, which makes it an error instead."""


@dataclass(frozen=True)
class ValidationReport:
    """What one validation found: a markdown table for people, metrics for the loggers."""

    title: str
    """What was measured (e.g. "digits quality")."""
    scope: str
    """How (e.g. "500 samples per row against the 360 held-out digits")."""
    table: str
    metrics: dict[str, float] = field(default_factory=dict)
    samples: Path | None = None
    """Where the samples and their pictures are."""
    images: dict[str, Any] = field(default_factory=dict)
    """Pictures for the Tracking backends: tag -> (H, W, 3) uint8 array."""
