"""Model assets shipped inside the package, addressed as ``builtin:<name>`` in model paths.

``digits_teacher``: the class-conditional DiT of the embedded digits default,
trained by ``scripts/train_digits_teacher.py --steps 3000`` (see docs/benchmarks.md
for its quality and docs/architecture.md for why it is committed rather than
trained on first use). A ``builtin:`` path keeps the plan's fingerprint the same on
every machine, wherever the package is installed.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_PREFIX = "builtin:"


def _assets_root() -> Path:
    from importlib.resources import files

    return Path(str(files("verl_dmd.assets")))


def builtin_models() -> list[str]:
    """Names of the shipped model directories."""
    return sorted(p.name for p in _assets_root().iterdir() if (p / "config.json").is_file())


def resolve_model_path(path: str) -> str:
    """A ``builtin:<name>`` path as the shipped directory; any other path unchanged."""
    if not path.startswith(BUILTIN_PREFIX):
        return path
    name = path[len(BUILTIN_PREFIX) :]
    folder = _assets_root() / name
    if not name or not (folder / "config.json").is_file():
        raise ValueError(
            f"model path {path!r}: no shipped model named {name!r}; allowed: "
            f"{', '.join(BUILTIN_PREFIX + n for n in builtin_models())}; fix: use one of those or a local "
            "diffusers model directory"
        )
    return str(folder)
