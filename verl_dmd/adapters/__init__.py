"""Model adapters: one class per model family, registered by name.

Import `get_adapter` / `register_adapter` from here; third-party packages
register through the ``verl_dmd.adapters`` entry-point group.
"""

from verl_dmd.adapters.base import DistributionMatchingModelAdapter, ModelSource
from verl_dmd.adapters.registry import available_adapters, get_adapter, register_adapter

__all__ = [
    "DistributionMatchingModelAdapter",
    "ModelSource",
    "available_adapters",
    "get_adapter",
    "register_adapter",
]
