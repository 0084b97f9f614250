"""Identity by content: SHA-256 of files and of a model folder's weights, the latter cached by file stats.

A prepared data set records the text encoders' and the VAE's weight digests, teacher
pairs record the teacher's; every launch checks them against the pipeline on disk.
Hashing a 9 GB T5 or a 16 GB Qwen2.5-VL takes seconds to tens of seconds, so a
folder's digest is kept in a small JSON cache (``$VERL_DMD_CACHE_DIR``, else
``$XDG_CACHE_HOME/verl_dmd``, else ``~/.cache/verl_dmd``) under the folder's real
path, valid while every weight file keeps its name, size, modification time and
inode. An edit that preserves all four (not something tools do) would go unseen;
``VERL_DMD_CACHE_DIR=off`` turns the cache off. An unwritable cache is skipped. A
process also keeps each digest in memory under the same rule (``off`` included), so
asking again costs a ``stat`` per weight file, not a read of the cache file.

A model folder's identity (`model_digests`) adds its ``config.json`` to its weights:
a plan's fingerprint holds it for each model the plan names by path.

Layer 1: the standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin")
OTHER_WEIGHT_SUFFIXES = (".msgpack", ".h5", ".onnx", ".ckpt", ".pt", ".pth", ".gguf")
"""Weights of other frameworks a model folder may also hold; diffusers and transformers load neither here."""
CACHE_FILE = "weights-sha256.json"
MODEL_CONFIG = "config.json"
_REMEMBERED: dict[str, tuple[list, str]] = {}
"""This process's weight digests: the folder's real path -> (its weight files' stats, the digest)."""


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of a file, read in 1 MB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """A model folder's weight files (safetensors and .bin, sharded ones included), in name order."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _cache_path() -> Path | None:
    chosen = os.environ.get("VERL_DMD_CACHE_DIR")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen) / CACHE_FILE
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "verl_dmd" / CACHE_FILE


def _stats(files: list[Path]) -> list[list]:
    out = []
    for file in files:
        stat = file.stat()
        out.append([file.name, stat.st_size, stat.st_mtime_ns, stat.st_ino])
    return out


def _read_cache(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path | None, entries: dict) -> None:
    if path is None:
        return
    with contextlib.suppress(OSError):  # a cache that cannot be written is only slower
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps(entries, sort_keys=True))
        os.replace(staging, path)


def weights_sha256(folder: Path) -> str:
    """SHA-256 over a model folder's weight files: each file's name then its bytes, in name order.

    The same digest whatever the folder is called or where it lies (only file names inside it
    count); ValueError (one line) when the folder holds no weight file.
    """
    folder = Path(folder)
    files = weight_files(folder) if folder.is_dir() else []
    if not files:
        raise ValueError(f"{folder}: no weight files (*.safetensors, *.bin) to identify the model by")
    cache_path = _cache_path()
    key = str(folder.resolve())
    stats = _stats(files)
    remembered = _REMEMBERED.get(key)
    if remembered is not None and remembered[0] == stats:
        return remembered[1]
    entries = _read_cache(cache_path)
    cached = entries.get(key)
    if isinstance(cached, dict) and cached.get("stats") == stats and isinstance(cached.get("sha256"), str):
        _REMEMBERED[key] = (stats, cached["sha256"])
        return cached["sha256"]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            for block in iter(lambda h=handle: h.read(1 << 20), b""):
                digest.update(block)
    value = digest.hexdigest()
    _REMEMBERED[key] = (stats, value)
    entries = _read_cache(cache_path)  # re-read: another process may have added entries meanwhile
    entries[key] = {"stats": stats, "sha256": value}
    _write_cache(cache_path, entries)
    return value


def model_digests(folder: Path) -> dict[str, str]:
    """A model folder's identity by content, the same wherever the folder lies or is called.

    ``weights_sha256`` (`weights_sha256`), ``config_sha256`` (its config.json's bytes: a changed config is
    another model, whatever the weights) and ``content_sha256`` (one digest of the two). ValueError (one
    line) when the folder holds no config.json or no weight file.
    """
    folder = Path(folder)
    if not (folder / MODEL_CONFIG).is_file():
        raise ValueError(f"{folder}: no {MODEL_CONFIG} to identify the model by")
    weights = weights_sha256(folder)
    config = file_sha256(folder / MODEL_CONFIG)
    content = hashlib.sha256(f"weights {weights}\n{MODEL_CONFIG} {config}\n".encode()).hexdigest()
    return {"weights_sha256": weights, "config_sha256": config, "content_sha256": content}


def config_files_sha256(folder: Path) -> str:
    """SHA-256 over every file of a folder tree that is not a weight file (configs, tokenizer files): each
    file's relative path then its bytes, in path order. Small files: not cached."""
    folder = Path(folder)
    digest = hashlib.sha256()
    skipped = WEIGHT_SUFFIXES + OTHER_WEIGHT_SUFFIXES
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(skipped)):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def model_sha256(path: str | None, subfolder: str | None, config: Mapping[str, Any] | None) -> str:
    """A model's identity: `weights_sha256` of its folder (``path``/``subfolder``, ``builtin:`` paths
    resolved), or ``config:`` + the SHA-256 of its config's canonical JSON when it is built from one."""
    from verl_dmd.assets import resolve_model_path
    from verl_dmd.plan.schema import to_plain

    if path is None:
        return "config:" + hashlib.sha256(json.dumps(to_plain(config), sort_keys=True).encode()).hexdigest()
    return weights_sha256(Path(resolve_model_path(path)) / (subfolder or ""))
