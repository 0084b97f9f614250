"""Distillation methods: phase computers registered by name (`algorithm.name`), and the samplers they share.

Import `register_method` / `get_method` / `available_methods` from here; third-party
packages register through the ``verl_dmd.algorithms`` entry-point group.
"""

from verl_dmd.algorithms.registry import available_methods, get_method, register_method

__all__ = ["available_methods", "get_method", "register_method"]
