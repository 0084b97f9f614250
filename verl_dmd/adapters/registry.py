"""The name -> model-adapter registry (decorator and entry points)."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable

from verl_dmd.adapters.base import DistributionMatchingModelAdapter

ENTRY_POINT_GROUP = "verl_dmd.adapters"
_BUILTIN_MODULES = ("verl_dmd.adapters.diffusers_transformers",)

_registry: dict[str, type[DistributionMatchingModelAdapter]] = {}
_loaded = False
logger = logging.getLogger(__name__)


def register_adapter(name: str) -> Callable[[type], type]:
    """Class decorator: make an adapter available as `model.adapter=<name>`."""

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, DistributionMatchingModelAdapter)):
            raise TypeError(f"@register_adapter({name!r}) needs a DistributionMatchingModelAdapter subclass")
        existing = _registry.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"model adapter {name!r} is registered twice ({existing.__module__}.{existing.__qualname__} "
                f"and {cls.__module__}.{cls.__qualname__}); pick another name"
            )
        cls.name = name
        _registry[name] = cls
        return cls

    return decorate


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()  # importing the module runs its @register_adapter decorators
        except Exception as err:  # a broken plugin must not hide the built-in adapters
            logger.warning("verl_dmd: model-adapter entry point %r failed to load: %s", entry.name, err)


def available_adapters() -> list[str]:
    """Names of every registered adapter (built-in and entry points)."""
    _load_all()
    return sorted(_registry)


def get_adapter(name: str) -> type[DistributionMatchingModelAdapter]:
    """The adapter class registered as `name`; an unknown name lists the registered ones."""
    _load_all()
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(
            f"config key 'model.adapter' = {name!r}: no such model adapter; registered: "
            f"{', '.join(sorted(_registry)) or 'none'}; fix: pick one, or install the package that "
            f"registers it (entry-point group {ENTRY_POINT_GROUP!r})"
        ) from None
