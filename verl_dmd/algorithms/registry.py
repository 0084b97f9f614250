"""The name -> distillation-method registry: `algorithm.name` selects a phase computer class.

A method is one module plus a registration: a `PhaseComputer` class decorated with
``@register_method("<name>")`` that builds itself from the plan with the classmethod
``from_plan(adapter, model_config, plan, *, rank)``. Built-in: ``dmd2``. A separately
installed package registers its own in a module named in the ``verl_dmd.algorithms``
entry-point group (see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

from verl_dmd.registry import Registry

ENTRY_POINT_GROUP = "verl_dmd.algorithms"


PROTOCOL = ("from_plan", "compute_phase", "extra_modules", "state_dict", "load_state_dict", "reseed")
"""What a registered method class must define (`from_plan` builds it; the rest is `PhaseComputer`)."""


def _check(name: str, entry: object) -> None:
    missing = (
        [m for m in PROTOCOL if not callable(getattr(entry, m, None))]
        if isinstance(entry, type)
        else ["a class"]
    )
    if missing:
        raise TypeError(
            f"@register_method({name!r}) needs a phase computer class with a classmethod "
            f"from_plan(adapter, model_config, plan, *, rank) and the PhaseComputer methods; missing: "
            f"{', '.join(missing)}"
        )


METHODS: Registry[type] = Registry(
    "distillation method",
    key="algorithm.name",
    entry_point_group=ENTRY_POINT_GROUP,
    builtin_modules=("verl_dmd.algorithms.dmd2",),
    builtin_names=("dmd2",),
    check=_check,
)


def register_method(name: str) -> Callable[[type], type]:
    """Class decorator: make a phase computer class available as ``algorithm.name=<name>``."""
    return METHODS.register(name)


def get_method(name: str) -> type:
    """The computer class registered as `name`; an unknown name lists the registered ones."""
    return METHODS.get(name)


def available_methods() -> list[str]:
    """Every registered method name (built-in and entry points)."""
    return METHODS.names()
