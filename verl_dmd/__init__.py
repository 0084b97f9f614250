"""verl_dmd: distribution-matching distillation (DMD2) of diffusion models on verl.

Importing the package is cheap (no torch, ray or verl import): the layers load
on first use. See docs/architecture.md for the map.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0.dev0"

__all__ = ["__version__", "config_dir", "recipes_dir"]


def _package_data_dir(package: str) -> Path:
    from importlib.resources import files

    path = Path(str(files(package)))
    if not path.is_dir():
        raise FileNotFoundError(
            f"verl_dmd data folder {package!r} not found at {path}: the install is incomplete; "
            "reinstall with `pip install .` from the repository root"
        )
    return path


def config_dir() -> Path:
    """The folder of the packaged hydra config tree (the top-level ``config/`` in the repo)."""
    return _package_data_dir("verl_dmd.config")


def recipes_dir() -> Path:
    """The folder of the packaged runnable recipes (the top-level ``recipes/`` in the repo)."""
    return _package_data_dir("verl_dmd.recipes")
