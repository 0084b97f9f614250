"""The name -> model-adapter registry: `model.adapter` selects a model family."""

from __future__ import annotations

from collections.abc import Callable

from verl_dmd.adapters.base import ATTENTION_KERNELS, DistributionMatchingModelAdapter
from verl_dmd.losses import PARAMETERIZATIONS
from verl_dmd.registry import Registry

ENTRY_POINT_GROUP = "verl_dmd.adapters"


def _check(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, DistributionMatchingModelAdapter)):
        raise TypeError(f"@register_adapter({name!r}) needs a DistributionMatchingModelAdapter subclass")
    if cls.parameterization not in PARAMETERIZATIONS:
        raise TypeError(
            f"@register_adapter({name!r}): parameterization = {cls.parameterization!r}; allowed: "
            f"{', '.join(PARAMETERIZATIONS)}"
        )
    if not 0.0 < float(cls.sigma_max) <= 1.0:
        raise TypeError(f"@register_adapter({name!r}): sigma_max = {cls.sigma_max!r}; must lie in (0, 1]")
    kernels = cls.excluded_attention_kernels
    if isinstance(kernels, str) or not all(k in ATTENTION_KERNELS for k in kernels):
        raise TypeError(
            f"@register_adapter({name!r}): excluded_attention_kernels = {kernels!r}; allowed: a tuple of "
            f"{', '.join(sorted(ATTENTION_KERNELS))}"
        )


ADAPTERS: Registry[type[DistributionMatchingModelAdapter]] = Registry(
    "model adapter",
    key="model.adapter",
    entry_point_group=ENTRY_POINT_GROUP,
    builtin_modules=("verl_dmd.adapters.diffusers_transformers",),
    builtin_names=("dit", "flux", "qwen_image", "sd3", "wan"),
    check=_check,
)


def register_adapter(name: str) -> Callable[[type], type]:
    """Class decorator: make an adapter available as `model.adapter=<name>`."""

    def decorate(cls: type) -> type:
        ADAPTERS.register(name)(cls)
        cls.name = name
        return cls

    return decorate


def available_adapters() -> list[str]:
    """Names of every registered adapter (built-in and entry points)."""
    return ADAPTERS.names()


def get_adapter(name: str) -> type[DistributionMatchingModelAdapter]:
    """The adapter class registered as `name`; an unknown name lists the registered ones."""
    return ADAPTERS.get(name)
