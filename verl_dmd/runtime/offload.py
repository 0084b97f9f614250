"""Sleep and wake: move every role's state out of device memory and back, keeping every object as it is.

`StateOffloader.sleep()` copies the complete storage behind each tensor of the
engine's state into one host buffer and frees the device storage by resizing it
to zero bytes; `wake()` resizes the storages back and copies the bytes in. The
state is: every parameter's local shard (FSDP2 keeps it as a view into a padded
1-D buffer: the whole padded storage moves), the independent layout's EMA, and
both optimizers' state tensors. Gradients are dropped at sleep.

Because only storages change, everything that refers to them stays valid:
parameter objects, optimizer bindings, DTensor specs, padding, strides, dtypes,
`requires_grad`, and tensors that share a storage (each storage moves once).

- On CUDA the host buffer is pinned, allocated once at the first sleep (pinned
  allocation runs at about 2 GB/s, far slower than the copies) and reused; the
  copies are non-blocking on one stream and synchronised once. After sleep the
  caching allocator's free blocks are released (`torch.cuda.empty_cache`), so the
  memory is available to other processes. With `pack=True` (off by default until
  its release path is measured on a GPU) wake allocates the storages inside a
  private memory pool, cut from one reserved segment: the driver then frees one
  segment at the next sleep instead of hundreds (each free costs ~40 us and waits
  for the device; see `StateOffloader._packed`).
- On CPU the same steps run with an ordinary host buffer: memory is released and
  restored the same way (the identity tests run this path); it saves nothing but
  keeps one code path.

The engine must be resharded (no gathered copies alive): `sleep` does it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from verl_dmd.runtime.engine import local_tensor

_SMALL_BLOCK = 1 << 20
"""Bytes up to which torch's CUDA caching allocator serves a request from its 2 MB small-block segments."""


def _packing_works() -> bool:
    """Packing relies on the default allocator splitting one large free block; these settings stop it
    (max_split_size_mb never splits oversize blocks, the others change rounding or the allocator)."""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")).lower()
    return not any(
        key in conf
        for key in ("max_split_size_mb", "expandable_segments:true", "cudamallocasync", "roundup_power2")
    )


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    offset: int
    nbytes: int


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffloader:
    """Sleep/wake of one `RoleEngine`'s device state (see the module docstring)."""

    ALIGN = 512  # bytes: keeps every slot of the host buffer aligned for fast copies

    def __init__(self, engine, *, pack: bool = False) -> None:
        self.engine = engine
        # pack: wake allocates the storages in few device segments (see `_packed`). Off by default: its
        # release path (dropping the pool at sleep) is not yet measured on a GPU (docs/benchmarks.md).
        self.pack = pack
        self.small_block = _SMALL_BLOCK  # storages up to this many bytes move as one block (`_small_block`)
        self.asleep = False
        self._buffer: torch.Tensor | None = None
        self._slots: list[_Slot] = []
        self._pool = None  # torch.cuda.MemPool for the state's storages (pack=True), made at a wake
        self._pool_bytes = 0
        self._cache: tuple[tuple[int, ...], list[torch.UntypedStorage], list[torch.Tensor]] | None = None
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ what moves

    def _state_objects(self) -> list[torch.Tensor]:
        """Every tensor of the state as the engine holds it (DTensors for sharded ones)."""
        engine = self.engine
        objects = [p for params in engine.params.values() for p in params]
        objects += list(engine.frozen_params)
        objects += list(engine.independent_ema)
        for optimizer in engine.optimizers.values():
            for state in optimizer.state.values():
                objects += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return objects

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, as local tensors (parameters, EMA, optimizer state)."""
        return [local_tensor(t) for t in self._state_objects()]

    def _storages(self) -> list[torch.UntypedStorage]:
        """The distinct device storages behind the state, cached while the set of state tensors is the same."""
        kind = self.engine.device.type  # one device per process: "cuda" and "cuda:0" are the same here
        objects = self._state_objects()
        key = tuple(map(id, objects))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        tensors = [t for t in map(local_tensor, objects) if t.device.type == kind]
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = storage
        storages = list(seen.values())
        self._cache = (key, storages, objects)  # the objects stay referenced, so their ids cannot be reused
        return storages

    @contextlib.contextmanager
    def _packed(self):
        """Allocate the storages of a wake in as few device segments as possible (`pack=True`).

        Returning memory to the driver costs one `cudaFree` per segment of the caching allocator
        (about 40 us each on an H200, and each one waits for the device), not per byte: 15 GB in one
        segment frees in 5-9 ms, in 1,280 segments of 12 MB in 53-61 ms (scripts/bench_release.py).
        The storages of a sharded model are thousands of separate allocations, so left alone they
        occupy hundreds of segments. Here every storage above the small-block size is cut from one
        segment reserved first (the allocator splits a free block to serve a smaller request),
        inside a private memory pool so that no other tensor lands in that segment and keeps it
        from being freed. The pool holds its segments until it is destroyed (`torch.cuda.empty_cache`
        skips a pool that is still referenced), so a releasing sleep drops it, and a wake makes a new
        one when the state's size changed (AdamW creates its state at the first step).
        """
        device = self.engine.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        large = sum(-(-s.nbytes // self.ALIGN) * self.ALIGN for s in self._slots if s.nbytes > _SMALL_BLOCK)
        if self._pool is not None and self._pool_bytes != large:
            self._pool = None  # asleep, so every block in it is free: its destructor frees the segments
        if self._pool is None:
            # Blocks of the state sitting free in the default pool (a first sleep with release=False)
            # go back to the driver before the pool takes the same amount again.
            torch.cuda.empty_cache()
            with torch.cuda.device(index):
                self._pool = torch.cuda.MemPool()
            self._pool_bytes = large
        with torch.cuda.use_mem_pool(self._pool, device=index):
            if large:
                torch.empty(large, dtype=torch.uint8, device=device)  # reserved, then free in the pool
            yield

    def _small_block(self) -> tuple[list[_Slot], int]:
        """The slots of storages up to the small-block size (first in `_slots`) and the bytes they span.

        Thousands of small tensors (LoRA factors and their AdamW state) cost a copy's latency each, not
        bandwidth; they move as one block instead: gathered on the device into one staging buffer with
        a multi-tensor copy, then one copy each way (scattered back the same way at wake). The staging
        buffer is device memory for the duration of the copy (the small storages' total).
        """
        small = [slot for slot in self._slots if slot.nbytes <= self.small_block]
        if not small:
            return [], 0
        last = small[-1]
        return small, last.offset + last.nbytes

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self._slots)

    # ------------------------------------------------------------------ sleep / wake

    def sleep(self, *, release: bool = True) -> dict[str, float]:
        """Copy the state to host memory and free its device storage; returns timings and sizes.

        `release` also returns the freed blocks to the CUDA driver (`torch.cuda.empty_cache`), so other
        processes can use them; without it they stay in this process's caching allocator, free for its
        other work (with `pack=True`: in the offloader's pool, kept for the next wake, which other
        allocations do not use) and the sleep skips the driver's frees.
        """
        if self.asleep:
            raise RuntimeError("sleep() while asleep: call wake() first")
        engine = self.engine
        started = time.perf_counter()
        engine.reshard()
        for role in engine.optimizers:
            engine.zero_grad(role)
        storages = self._storages()
        # Small storages first, contiguous in the host buffer: they move as one block (see `_small_block`).
        storages = sorted(storages, key=lambda st: st.nbytes() > self.small_block)
        slots, offset = [], 0
        for storage in storages:
            slots.append(_Slot(storage, offset, storage.nbytes()))
            offset += -(-storage.nbytes() // self.ALIGN) * self.ALIGN
        cuda = engine.device.type == "cuda"
        allocated = 0.0
        if self._buffer is None or self._buffer.numel() < offset:
            begin = time.perf_counter()
            self._buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=cuda)
            allocated = time.perf_counter() - begin
        self._slots = slots
        prepared = time.perf_counter() - started
        copy_started = time.perf_counter()
        small, small_bytes = self._small_block()
        if small:
            stage = torch.empty(small_bytes, dtype=torch.uint8, device=engine.device)
            torch._foreach_copy_(
                [stage[s.offset : s.offset + s.nbytes] for s in small], [_bytes_of(s.storage) for s in small]
            )
            self._buffer[:small_bytes].copy_(stage, non_blocking=cuda)
            for slot in small:
                slot.storage.resize_(0)
            del stage  # freed in stream order, after the copy
        for slot in slots[len(small) :]:
            self._buffer[slot.offset : slot.offset + slot.nbytes].copy_(
                _bytes_of(slot.storage), non_blocking=cuda
            )
            # Freeing right away is safe: the caching allocator reuses a block only for work queued after
            # this copy on the same stream; the CPU work of freeing overlaps the copies.
            slot.storage.resize_(0)
        if cuda:
            torch.cuda.synchronize(engine.device)
        copy_seconds = time.perf_counter() - copy_started
        released = time.perf_counter()
        if cuda and release:
            self._pool = None  # its destructor frees the pool's segments (empty_cache skips live pools)
            torch.cuda.empty_cache()
        released = time.perf_counter() - released
        self.asleep = True
        self.last = {"sleep_s": time.perf_counter() - started, "sleep_copy_s": copy_seconds,
                     "sleep_prepare_s": prepared, "sleep_release_s": released,
                     "pinned_alloc_s": allocated, "bytes": float(self.nbytes)}  # fmt: skip
        return dict(self.last)

    def wake(self) -> dict[str, float]:
        """Give every storage its bytes back (same objects, same sizes); returns timings."""
        if not self.asleep:
            raise RuntimeError("wake() while awake: call sleep() first")
        cuda = self.engine.device.type == "cuda"
        started = time.perf_counter()
        copy_started = time.perf_counter()
        small, small_bytes = self._small_block()
        stage = None
        if small:  # outside the pool: the reserved segment is sized for the large storages alone
            stage = torch.empty(small_bytes, dtype=torch.uint8, device=self.engine.device)
            stage.copy_(self._buffer[:small_bytes], non_blocking=cuda)
        with self._packed() if cuda and self.pack and _packing_works() else contextlib.nullcontext():
            for slot in self._slots[len(small) :]:  # allocating the next storage overlaps queued copies
                slot.storage.resize_(slot.nbytes)
                _bytes_of(slot.storage).copy_(
                    self._buffer[slot.offset : slot.offset + slot.nbytes], non_blocking=cuda
                )
            for slot in small:
                slot.storage.resize_(slot.nbytes)
        if small:
            torch._foreach_copy_(
                [_bytes_of(s.storage) for s in small], [stage[s.offset : s.offset + s.nbytes] for s in small]
            )
            del stage
        if cuda:
            torch.cuda.synchronize(self.engine.device)
        self.asleep = False
        self.last.update(
            {"wake_s": time.perf_counter() - started, "wake_copy_s": time.perf_counter() - copy_started}
        )
        return dict(self.last)
