"""Reading checkpoint files without running code from them, and checking their SHA-256 as they are read.

Two guarantees for every file a resume or an export reads:

- **No code runs.** DCP's ``.metadata`` is a pickle; `load_dcp_metadata` reads it with
  an unpickler that resolves only the classes DCP's metadata is made of (an allow-list:
  `_ALLOWED`), so a planted ``__reduce__`` payload is refused before it can run.
  Tensor entries are read with ``torch.load(weights_only=True)``; an entry that the
  metadata declares as pickled bytes (DCP would read it with ``weights_only=False``)
  is refused: verl_dmd's engine state holds tensors only. RNG files are read with
  ``torch.load(weights_only=True)``, JSON files as JSON.
- **Damage is seen.** Each file is hashed while it is read, in the same pass
  (`read_verified`, and `VerifiedReader` for DCP's data files, which reads every
  byte of each file in order, gaps included), and the digest is compared with the
  manifest's. A mismatch is recorded (`VerifiedReader.damaged`) or raised
  (`read_verified`) as a `CheckpointError` naming the file.

`DeterministicWriter` is DCP's file writer with the one non-reproducible field of
``.metadata`` (the save's random id and the staging path) left empty, so two
identical runs write identical checkpoints, byte for byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import pathlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta

from verl_dmd.checkpoint.store import CheckpointError

BLOCK = 8 << 20
"""Bytes read (and hashed) at a time."""

METADATA_FILE = ".metadata"


def _layout(name: str) -> torch.layout:
    """`torch.serialization._get_layout`'s job, for torch's own layout names only."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _allowed() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(metadata, name)
    }
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    allowed[("pathlib", "PosixPath")] = pathlib.PurePosixPath  # the writer's path: kept as text, never used
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    return allowed


_ALLOWED: dict[tuple[str, str], Any] | None = None


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes and torch dtypes; everything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        global _ALLOWED
        if _ALLOWED is None:
            _ALLOWED = _allowed()
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata (refused)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata (refused)")


def load_dcp_metadata(data: bytes, where: Path | str):
    """DCP's `Metadata` from the bytes of a ``.metadata`` file, through the allow-list unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # whatever a damaged or hostile pickle raises
        raise CheckpointError(
            f"{where}: not DCP metadata, refused without running it ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{where}: not DCP metadata (holds {type(metadata).__name__})")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{where}: DCP metadata without its storage index")
    return metadata


def read_verified(path: Path, sha256: str | None) -> bytes:
    """The bytes of `path`, hashed as they are read; CheckpointError if the digest is not `sha256`
    (None: no check)."""
    digest = hashlib.sha256()
    chunks = []
    try:
        if not path.is_file():
            raise CheckpointError(f"{path}: missing or not a regular file")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(BLOCK), b""):
                digest.update(block)
                chunks.append(block)
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable ({err.strerror or err})") from None
    if sha256 is not None and digest.hexdigest() != sha256:
        raise CheckpointError(f"{path}: SHA-256 differs from the manifest (the file is damaged)")
    return b"".join(chunks)


def load_tensor_file(path: Path, sha256: str | None) -> dict[str, torch.Tensor]:
    """A ``torch.save``d dict of tensors (an RNG file), verified, read with ``weights_only=True``."""
    data = read_verified(path, sha256)
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"{path}: not a tensor file, refused without running it ({type(err).__name__})"
        ) from None
    if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
        raise CheckpointError(f"{path}: holds {type(value).__name__}, not a dict of tensors")
    return value


class DeterministicWriter(FileSystemWriter):
    """DCP's file writer without the random save id and the writer's path in ``.metadata``."""

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()


class VerifiedReader(FileSystemReader):
    """DCP's file reader that refuses code and checks each data file's SHA-256 while reading it.

    `expected` maps file names inside the DCP directory (``.metadata``, ``__0_0.distcp``) to
    their SHA-256 from the manifest; None reads without checking (``checkpoint.verify_hashes=false``),
    still through the allow-list unpickler. The metadata is read and checked when the reader is
    made (a damaged one raises CheckpointError then, before DCP starts a collective). Damage in a
    data file is recorded in `damaged`, not raised inside DCP's collective: the caller agrees on it
    across ranks; the tensors of a damaged file may already have been copied, so the caller must
    not use the state it loaded into (a resume loads an older checkpoint over all of it).
    """

    def __init__(self, path: str | Path, expected: Mapping[str, str] | None = None) -> None:
        super().__init__(str(path))
        self.directory = Path(path)
        self.expected = expected
        self.damaged: list[str] = []
        self.verified: set[str] = set()
        metadata_path = self.directory / METADATA_FILE
        try:
            present = metadata_path.is_file()
        except OSError as err:
            raise CheckpointError(f"{metadata_path}: unreadable ({err.strerror or err})") from None
        if not present:
            raise CheckpointError(f"{metadata_path}: missing (not a DCP checkpoint directory)")
        data = read_verified(metadata_path, self._expected(METADATA_FILE))
        self.verified.add(METADATA_FILE)
        self._metadata = load_dcp_metadata(data, metadata_path)

    def _expected(self, name: str) -> str | None:
        if self.expected is None:
            return None
        if name not in self.expected:
            raise CheckpointError(f"{self.directory / name}: not listed in the manifest (refused)")
        return self.expected[name]

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = self._metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> torch.futures.Future:
        from torch.distributed.checkpoint.planner import LoadItemType

        per_file: dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
        for name, items in sorted(per_file.items()):
            path = self.directory / name
            try:
                self._read_file(path, name, items, planner, LoadItemType)
            except CheckpointError as err:
                self.damaged.append(str(err))
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_file(self, path: Path, name: str, items: list, planner, item_types) -> None:
        """Map `path`, hash all of it on a helper thread while `items` are deserialized from the same
        pages, then compare the digest (the tensors are already copied: see the class docstring)."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        if Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"{self.directory}: the metadata names a data file {name!r} (refused)")
        expected = self._expected(name)
        if any(item.type == item_types.BYTE_IO for item in items):
            raise CheckpointError(f"{path}: holds a pickled (non-tensor) entry, refused without running it")
        by_offset: dict[tuple[int, int], list] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise CheckpointError(
                    f"{path}: written with DCP stream transforms, which verl_dmd does not use"
                )
            by_offset.setdefault((int(info.offset), int(info.length)), []).append(item)
        try:
            if not path.is_file():  # a FIFO or device named by the metadata would block or never end
                raise CheckpointError(f"{path}: named by the metadata, not a regular file")
            with path.open("rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable ({err})") from None
        view = memoryview(mapped)
        hasher = _BackgroundHash(view) if expected is not None else None
        try:
            position = 0
            for (offset, length), requests in sorted(by_offset.items()):
                if offset < position or offset + length > size:
                    raise CheckpointError(f"{path}: its metadata names bytes it does not hold (damaged)")
                position = offset + length
                self._deliver(path, offset, view[offset:position], requests, planner, narrow_tensor_by_index)
            if hasher is not None and hasher.hexdigest() != expected:
                raise CheckpointError(f"{path}: SHA-256 differs from the manifest (the file is damaged)")
        finally:
            if hasher is not None:
                hasher.close()
            with contextlib.suppress(BufferError):  # a view still held by a failed load: freed with it
                view.release()
                if size:
                    mapped.close()
        self.verified.add(name)

    @staticmethod
    def _deliver(path: Path, offset: int, data: memoryview, requests: list, planner, narrow) -> None:
        """One stored entry's bytes to the tensors that asked for (parts of) it."""
        try:
            tensor = torch.load(_MemoryFile(data), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"{path}: an entry at byte {offset} is not a tensor, refused without running it "
                f"({type(err).__name__})"
            ) from None
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: an entry at byte {offset} holds {type(tensor).__name__}")
        for request in requests:
            part = narrow(tensor, request.storage_offsets, request.lengths)
            target = planner.resolve_tensor(request).detach()
            if target.size() != part.size():
                raise CheckpointError(
                    f"{path}: entry {request.storage_index.fqn} has shape {tuple(part.size())}, "
                    f"the engine expects {tuple(target.size())} (damaged metadata?)"
                )
            target.copy_(part)
            planner.commit_tensor(request, target)


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview, without copying it (torch.load reads it with
    `readinto`, straight into the tensor's storage)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        count = max(0, min(len(target), len(self._view) - self._position))
        memoryview(target).cast("B")[:count] = self._view[self._position : self._position + count]
        self._position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position


class _BackgroundHash:
    """SHA-256 of a mapped file computed on a helper thread (hashlib releases the GIL), so hashing
    overlaps deserializing the same pages: the file is read from storage once, for both."""

    def __init__(self, view: memoryview) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-dmd-sha256")
        self._done = self._pool.submit(self._hash, view)

    def _hash(self, view: memoryview) -> None:
        self._digest.update(view)  # one call: the GIL is released for all of it

    def hexdigest(self) -> str:
        self._done.result()
        return self._digest.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
