"""Atomic publication, verification, resolution and retention of checkpoint directories.

This module knows files, not tensors: whatever writes a checkpoint's contents
(DCP for model and optimizer state, ``torch.save`` of plain tensors for the rest)
writes them into a staging directory from `CheckpointStore.begin`; `publish` then

1. hashes every file and writes ``manifest.json`` (sizes and SHA-256 of every
   file, format version, plan fingerprint, world size, counters),
2. fsyncs every file and directory,
3. renames the staging directory to ``global_step_<N>`` (atomic on POSIX),
4. replaces the ``latest`` pointer atomically (write a temporary file, fsync,
   ``os.replace``),
5. applies retention (keep the newest ``keep_last``, plus every ``keep_every``-th).

A crash at any point leaves either the previous complete checkpoint as the
newest one or the new one complete; staging directories left by a crash are
never read and are removed by the next `begin`. `resolve("auto")` returns the
newest checkpoint whose manifest checks out and whose files have their recorded
sizes (and SHA-256 on request), warning (naming the damaged file) about every
newer one it skips; ``latest`` is for people and tools
(and is never deleted by retention), resolution does not depend on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_dmd.digests import file_sha256

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STAGING_PREFIX = ".staging-"
SET_ASIDE_PREFIX = ".set-aside-"
_NAME = re.compile(r"^global_step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, named with what is wrong and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    """One published checkpoint: its directory and its parsed manifest."""

    path: Path
    manifest: Mapping[str, Any]

    @property
    def global_step(self) -> int:
        return int(self.manifest["global_step"])


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without its own checksum: any edit of it shows."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(global_step: int) -> str:
    return f"global_step_{global_step}"


class CheckpointStore:
    """The checkpoint root of one run; a single writer (the driver or rank 0) publishes into it.

    `fault_hook(point)` is called at every step of `publish`, and by writers into the
    staging directory through `fault` (tests inject crashes there).
    """

    def __init__(self, root: str | Path, *, fault_hook: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self._fault = fault_hook or (lambda point: None)

    def fault(self, point: str) -> None:
        """A fault-injection point of a writer (no-op without a hook)."""
        self._fault(point)

    # ------------------------------------------------------------------ writing

    def begin(self, global_step: int) -> Path:
        """A fresh, empty staging directory for the checkpoint of `global_step`; stale ones are removed."""
        if not isinstance(global_step, int) or global_step < 0:
            raise CheckpointError(f"global_step = {global_step!r}: must be an integer >= 0")
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_staging()
        staging = self.root / f"{STAGING_PREFIX}{step_dir_name(global_step)}-{uuid.uuid4().hex[:12]}"
        staging.mkdir()
        return staging

    def clean_staging(self) -> list[Path]:
        """Remove staging directories and pointer temporaries (a crash's leftovers); returns them."""
        removed = []
        if self.root.is_dir():
            for path in sorted(self.root.iterdir()):
                if path.name.startswith(STAGING_PREFIX) and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                elif path.name.startswith(f".{LATEST}.") and path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # a pointer write cut short
                    removed.append(path)
        return removed

    def publish(
        self,
        staging: Path,
        *,
        global_step: int,
        fingerprint: str,
        world_size: int,
        counters: Mapping[str, int] | None = None,
        keep_last: int = 0,
        keep_every: int = 0,
        extra: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Seal `staging` (manifest, fsync), rename it into place, move `latest`, apply retention.

        `extra` adds JSON-able entries to the manifest (the plan's semantic dict, for resume checks)."""
        staging = Path(staging)
        if staging.parent != self.root or not staging.name.startswith(STAGING_PREFIX):
            raise CheckpointError(f"{staging}: not a staging directory of {self.root} (use begin())")
        target = self.root / step_dir_name(global_step)
        if target.exists():
            raise CheckpointError(
                f"checkpoint {target} already exists; a step is saved once (fix: resume from it, or remove it)"
            )
        files = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            relative = path.relative_to(staging).as_posix()
            if relative == MANIFEST:
                raise CheckpointError(f"{staging}: {MANIFEST} is written by publish(), not by the caller")
            self._fault(f"hash:{relative}")
            files[relative] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
            _fsync_file(path)
        if not files:
            raise CheckpointError(f"{staging}: nothing to publish (no files)")
        manifest = {
            "format_version": FORMAT_VERSION,
            "global_step": global_step,
            "plan_fingerprint": fingerprint,
            "world_size": world_size,
            "counters": dict(counters or {}),
            "files": files,
        }
        clash = sorted(set(extra or {}) & {*manifest, "manifest_sha256"})
        if clash:
            raise CheckpointError(f"extra manifest keys {clash} clash with the manifest's own")
        manifest.update(extra or {})
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        self._fault("manifest:write")
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        self._fault("manifest:fsync")
        _fsync_file(staging / MANIFEST)
        for directory in sorted({p.parent for p in staging.rglob("*")} | {staging}):
            _fsync_dir(directory)
        self._fault("dirs:fsync")
        self._fault("rename")
        os.rename(staging, target)
        _fsync_dir(self.root)
        self._fault("latest:write")
        pointer = self.root / f".{LATEST}.{uuid.uuid4().hex[:12]}.tmp"
        pointer.write_text(target.name + "\n")
        _fsync_file(pointer)
        self._fault("latest:replace")
        os.replace(pointer, self.root / LATEST)
        _fsync_dir(self.root)
        self._fault("retention")
        self.apply_retention(keep_last=keep_last, keep_every=keep_every)
        return Checkpoint(target, manifest)

    def apply_retention(self, *, keep_last: int, keep_every: int) -> list[Path]:
        """Delete published checkpoints beyond the newest `keep_last` (0: keep all), sparing every
        `keep_every`-th step and whatever `latest` names; returns the deleted directories."""
        if keep_last <= 0:
            return []
        steps = sorted(self._published(), reverse=True)
        keep = {step for step, _ in steps[:keep_last]}
        keep |= {step for step, _ in steps if keep_every > 0 and step % keep_every == 0}
        protected = self._latest_name()
        deleted = []
        for step, path in steps:
            if step not in keep and path.name != protected:
                self._fault(f"delete:{path.name}")
                shutil.rmtree(path)
                deleted.append(path)
        return deleted

    def set_aside_newer_than(self, global_step: int) -> list[Path]:
        """Rename every published checkpoint after `global_step` to ``.set-aside-global_step_<N>-<nonce>``.

        A run resumed from step S (an explicit older path, or the newest *intact* one while newer
        ones are damaged), or started afresh (S = -1), starts a new timeline: the old timeline's later
        checkpoints must neither be picked by ``auto`` after the next crash, count in retention, nor
        block saving those steps again. They are kept, hidden, for people to inspect or delete."""
        moved = []
        for step, path in sorted(self._published()):
            if step > global_step:
                target = self.root / f"{SET_ASIDE_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}"
                os.rename(path, target)
                moved.append(target)
        if moved:
            _fsync_dir(self.root)
            warnings.warn(
                f"checkpoints after step {global_step} belong to an abandoned run and were set aside: "
                f"{', '.join(p.name for p in moved)} (never read; delete them when no longer needed)",
                stacklevel=2,
            )
        return moved

    # ------------------------------------------------------------------ reading

    def _published(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _NAME.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return found

    def _latest_name(self) -> str | None:
        try:
            name = (self.root / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return name if _NAME.match(name) else None

    @staticmethod
    def verify(path: str | Path, *, hashes: bool = False) -> Checkpoint:
        """The checkpoint at `path` if its manifest parses and every listed file has its size (and
        SHA-256 with `hashes`); else CheckpointError naming the damaged file."""
        path = Path(path)
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{manifest_path}: missing (not a complete checkpoint)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{manifest_path}: unreadable or truncated ({err})") from None
        required = ("format_version", "global_step", "plan_fingerprint", "world_size", "files")
        if not isinstance(manifest, dict) or any(key not in manifest for key in required):
            raise CheckpointError(f"{manifest_path}: not a verl_dmd manifest (needs {', '.join(required)})")
        if manifest.get("manifest_sha256") != _manifest_digest(manifest):
            raise CheckpointError(
                f"{manifest_path}: its checksum does not match its content (the file is damaged)"
            )
        if manifest["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest_path}: format_version {manifest['format_version']!r}, this verl_dmd reads "
                f"{FORMAT_VERSION}; fix: resume with the verl_dmd version that wrote it"
            )
        _check_files(manifest_path, manifest["files"])
        match = _NAME.match(path.name)
        if match and int(match.group(1)) != manifest["global_step"]:
            raise CheckpointError(
                f"{manifest_path}: global_step {manifest['global_step']!r} does not match the directory name"
            )
        for relative, entry in manifest["files"].items():
            file = path / relative
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in the manifest but missing")
            size = file.stat().st_size
            if size != entry["size"]:
                raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['size']} (truncated?)")
            if hashes and file_sha256(file) != entry["sha256"]:
                raise CheckpointError(f"{file}: SHA-256 differs from the manifest (the file is damaged)")
        return Checkpoint(path, manifest)

    def resolve(self, resume: str, *, hashes: bool = False) -> Checkpoint | None:
        """`disable` -> None; a path -> that checkpoint, verified; `auto` -> the newest verified one
        (None if there is none), warning about each newer damaged one it skips."""
        if resume == "disable":
            return None
        if resume != "auto":
            return self.verify(resume, hashes=hashes)
        # Newest first, whatever `latest` says: a directory is renamed into place only when complete,
        # so one the pointer does not name yet (a crash between the two) is still safe to use.
        for _, path in sorted(self._published(), reverse=True):
            try:
                return self.verify(path, hashes=hashes)
            except CheckpointError as err:
                warnings.warn(f"skipping damaged checkpoint: {err}", stacklevel=2)
        return None

    def candidates(self, resume: str) -> Resumable:
        """What `resume` may load, newest first, each with its manifest and file sizes checked, and the
        damage found in the others; the file hashes are checked while a candidate is loaded.

        ``auto``: this root's published checkpoints. A path: that checkpoint (`explicit`: no fallback
        when it turns out damaged), or, when the path is a root that holds checkpoints, that root's.
        Anything else (``latest``, a missing path, a file, a folder that is no checkpoint) is a
        CheckpointError naming ``checkpoint.resume``.
        """
        if resume == "disable":
            return Resumable([], [], explicit=False)
        if resume == "auto":
            return _scan(self.root)
        path = Path(resume).expanduser()
        allowed = "allowed: auto (the newest intact checkpoint), disable, or a checkpoint directory"
        if resume == LATEST and not path.exists():
            raise CheckpointError(
                f"config key 'checkpoint.resume' = 'latest': not a checkpoint; {allowed}; "
                "fix: checkpoint.resume=auto"
            )
        if not path.exists():
            raise CheckpointError(
                f"config key 'checkpoint.resume' = {resume!r}: no such directory; {allowed}; fix: point it "
                "at a global_step_<N> directory (or a checkpoint root), or use auto"
            )
        if not path.is_dir():
            raise CheckpointError(
                f"config key 'checkpoint.resume' = {resume!r}: a file, not a checkpoint directory; {allowed}"
            )
        if (path / MANIFEST).exists():
            return Resumable([CheckpointStore.verify(path)], [], explicit=True)
        found = _scan(path)
        if not found.checkpoints and not found.damaged:
            raise CheckpointError(
                f"config key 'checkpoint.resume' = {resume!r}: neither a checkpoint (no {MANIFEST}) nor a "
                f"root holding global_step_<N> checkpoints; {allowed}"
            )
        return found


def _check_files(manifest_path: Path, files: Any) -> None:
    """The manifest's file list has the form publish() writes: relative paths inside the checkpoint (no
    ``..``, not absolute), each with an integer size and a hex SHA-256."""
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{manifest_path}: its file list is not a mapping of files (damaged)")
    for relative, entry in files.items():
        parts = Path(str(relative)).parts
        if (not isinstance(relative, str) or not parts or Path(relative).is_absolute() or ".." in parts
                or not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)):  # fmt: skip
            raise CheckpointError(f"{manifest_path}: file entry {relative!r} is malformed (refused)")


@dataclass(frozen=True)
class Resumable:
    """The checkpoints a resume may load (newest first) and one line per damaged one already seen."""

    checkpoints: list[Checkpoint]
    damaged: list[str]
    explicit: bool = False
    """True when `resume` named one checkpoint: a damaged one is an error, never a fallback."""
    root: Path | None = None
    """The root that was scanned (None: one named checkpoint, or nothing)."""


def _scan(root: Path) -> Resumable:
    found, damaged = [], []
    for _, path in sorted(CheckpointStore(root)._published(), reverse=True):
        try:
            found.append(CheckpointStore.verify(path))
        except CheckpointError as err:
            damaged.append(str(err))
    return Resumable(found, damaged, root=root)
