"""The prepared data set on disk: what `verl-dmd-prepare` writes and the `embeddings` provider reads.

Layout of a data set directory (``data.path``)::

    prepare.json                      what the data set is (the intent), written before any shard
    prompts-00000.safetensors ...     cond.<name> rows of prompts [k * shard_size, (k + 1) * shard_size)
    uncond.safetensors                uncond.<name>: one row, the negative (empty) prompt, for CFG
    validation.safetensors            cond.<name> of the validation prompts (optional)
    real-00000.safetensors ...        real.x0 (VAE latents) and real.cond.<name> of captioned images (optional)
    pairs-00000.safetensors ...       regression.noise / regression.target, row-aligned with the prompt
                                      shards: the teacher's sample from that noise for that prompt (optional)
    manifest.json                     the intent plus every file's rows, size and SHA-256: written last,
                                      so its presence means the data set is complete

Each shard is written under a temporary name and renamed into place, so a file
with a shard's name is complete; a run stopped half-way is continued by running the
same command again (the intent must be equal; the missing shards are made). Each
shard's header metadata carries, as one canonical JSON string under the key
``verl_dmd`` (safetensors orders several metadata keys differently in every
process, which would make equal shards differ in bytes), the data set id (the
SHA-256 of the intent), its part and index, and the prompts it encodes, so a file
is traceable on its own. Tensors of one key have the same trailing shape in every shard, except the
*ragged* keys (variable-length text, Qwen-Image): those are padded with zeros to
the longest row of their shard and come with a mask key (1 = a real token); the
manifest names them (``ragged``), and readers pad or trim them per batch.

Layer 2: safetensors and torch; nothing above the data sets.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "verl_dmd.prepared/1"
MANIFEST = "manifest.json"
INTENT = "prepare.json"
UNCOND_FILE = "uncond.safetensors"
VALIDATION_FILE = "validation.safetensors"
SHARDED_PARTS = ("prompts", "real", "pairs")


def teacher_pipeline(plan) -> Path | None:
    """The teacher's pipeline directory: model.teacher.path when the teacher is a subfolder of it and it holds a
    model_index.json; None otherwise (a bare transformer directory, or a config-built teacher)."""
    teacher = plan.model.teacher
    if teacher.path is None or not teacher.subfolder:
        return None
    root = Path(teacher.path).expanduser()
    return root if (root / "model_index.json").is_file() else None


class DatasetError(ValueError):
    """A data set directory or file that cannot be used as it is; the message is one line."""


def shard_name(part: str, index: int) -> str:
    """File name of shard `index` of a sharded part (prompts, real, pairs)."""
    return f"{part}-{index:05d}.safetensors"


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def dataset_id(intent: Mapping[str, Any]) -> str:
    """The SHA-256 of the intent's canonical JSON: one data set, one id."""
    return hashlib.sha256(canonical_json(intent).encode()).hexdigest()


def write_atomic_json(path: Path, value: Any) -> None:
    """Write JSON under a temporary name, flush it to disk and rename it into place."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with staging.open("w") as handle:
        handle.write(json.dumps(value, indent=1, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)


SHARD_METADATA = "verl_dmd"


def write_shard(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Write a safetensors shard under a temporary name, flushed to disk, then rename it into place
    (`before_rename`: a fault-injection point for tests, called between the two). `metadata` goes into the
    header as one canonical JSON string, so equal shards are equal bytes."""
    import safetensors.torch

    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
    data = safetensors.torch.save(tensors, metadata={SHARD_METADATA: canonical_json(dict(metadata))})
    with staging.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(staging, path)


def remove_staging_files(directory: Path) -> list[Path]:
    """Delete the temporary files a stopped writer left behind; the ones deleted."""
    removed = [p for p in directory.glob(".*.tmp") if p.is_file()]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except OSError as err:
        raise DatasetError(f"{path}: cannot read the {what} ({err.strerror})") from None
    except ValueError as err:
        raise DatasetError(f"{path}: the {what} is not valid JSON ({err}); fix: run verl-dmd-prepare again "
                           "into an empty directory") from None  # fmt: skip
    if not isinstance(value, dict):
        raise DatasetError(f"{path}: the {what} is not a JSON object")
    return value


@dataclass(frozen=True)
class PreparedDataset:
    """A complete prepared data set: its manifest, checked for form, and its files' paths."""

    root: Path
    manifest: dict[str, Any]

    @classmethod
    def is_prepared(cls, root: Path) -> bool:
        """Whether `root` is a directory made by verl-dmd-prepare (complete or not)."""
        return root.is_dir() and ((root / MANIFEST).is_file() or (root / INTENT).is_file())

    @classmethod
    def open(cls, root: Path) -> PreparedDataset:
        """Read and check the manifest; DatasetError (one line) when the data set is incomplete or damaged."""
        root = Path(root)
        if not (root / MANIFEST).is_file():
            if (root / INTENT).is_file():
                raise DatasetError(f"{root}: the data set is incomplete (no {MANIFEST}: verl-dmd-prepare did not "
                                   "finish); fix: run the same verl-dmd-prepare command again to complete it")  # fmt: skip
            raise DatasetError(
                f"{root}: no {MANIFEST}; fix: point data.path at a directory made by verl-dmd-prepare"
            )
        manifest = read_json(root / MANIFEST, "manifest")
        if manifest.get("format") != FORMAT:
            raise DatasetError(f"{root / MANIFEST}: format {manifest.get('format')!r}, this verl_dmd reads "
                               f"{FORMAT!r}; fix: prepare the data set again with this version")  # fmt: skip
        for key in ("intent", "files", "latent_shape", "prompt_count"):
            if key not in manifest:
                raise DatasetError(f"{root / MANIFEST}: no {key!r} entry; fix: prepare the data set again")
        dataset = cls(root, manifest)
        for entry in dataset.all_files():
            path = root / entry["file"]
            if Path(entry["file"]).name != entry["file"]:
                raise DatasetError(
                    f"{root / MANIFEST}: file entry {entry['file']!r} is not a plain file name"
                )
            if not path.is_file():
                raise DatasetError(f"{path}: listed in the manifest but missing; fix: run verl-dmd-prepare "
                                   "again (it remakes missing shards only after the manifest is removed) or "
                                   "restore the file")  # fmt: skip
            if path.stat().st_size != entry["size"]:
                raise DatasetError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['size']}; "
                                   "fix: restore the file or prepare the data set again")  # fmt: skip
        return dataset

    @property
    def intent(self) -> dict[str, Any]:
        return self.manifest["intent"]

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.manifest["latent_shape"])

    @property
    def ragged(self) -> dict[str, str]:
        """Ragged key -> its mask key (both with their part's prefix removed, e.g. ``encoder_hidden_states``)."""
        return dict(self.manifest.get("ragged", {}))

    def files(self, part: str) -> list[Path]:
        """The shard paths of a sharded part (empty when the data set has none), or the one file of
        `uncond` / `validation`."""
        entries = self.manifest["files"].get(part)
        if entries is None:
            return []
        if isinstance(entries, dict):
            entries = [entries]
        return [self.root / e["file"] for e in entries]

    def all_files(self) -> list[dict[str, Any]]:
        out = []
        for entries in self.manifest["files"].values():
            out.extend([entries] if isinstance(entries, dict) else entries)
        for entry in out:
            if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                    and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):  # fmt: skip
                raise DatasetError(f"{self.root / MANIFEST}: malformed file entry {entry!r}")
        return out

    def prompts(self, part: str = "validation") -> list[str]:
        """The prompt texts of a single-file part, from its header."""
        (path,) = self.files(part)
        return shard_prompts(path)


def shard_metadata(path: Path) -> dict[str, Any]:
    """What a shard's header records (`write_shard`)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return json.loads(metadata.get(SHARD_METADATA, "{}"))


def shard_prompts(path: Path) -> list[str]:
    """The prompt texts a shard's header records (empty when it records none)."""
    return list(shard_metadata(path).get("prompts", []))
