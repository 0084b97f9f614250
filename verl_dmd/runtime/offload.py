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
Once, at the first sleep (and again when the set of state tensors changes), the
small storages are coalesced: every tensor object using one is pointed at its
bytes inside a shared buffer of about 64 MB (`StateOffloader.coalesce`; only
when the storage's use count shows that every holder is known). Replacing a
state tensor's storage behind the offloader's back (`p.data = ...`) between
sleeps is not supported: the offloader would move the old storage.

- On CUDA the host buffer is pinned, allocated once at the first sleep (pinned
  allocation is far slower than the copies) and reused; the
  copies are non-blocking on one stream and synchronised once. After sleep the
  caching allocator's free blocks are released (`torch.cuda.empty_cache`), so the
  memory is available to other processes. With `pack=True` (the default) wake
  allocates the storages inside a private memory pool, cut from segments of
  64 MB reserved run by run: the driver then frees a few hundred large segments
  at the next sleep instead of the allocator's many (each free waits for the
  device; see `StateOffloader._packed_wake`). Small storages move
  as one staged block (see `StateOffloader._small_to_host`).
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
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

_SMALL_BLOCK = 1 << 20
"""Bytes up to which torch's CUDA caching allocator serves a request from its 2 MB small-block segments."""

_CHUNK = 64 << 20
"""Bytes of device memory a packed wake reserves at a time (see `StateOffloader._packed_wake`)."""


def plan_chunks(sizes: list[int], target: int) -> list[tuple[int, int, int]]:
    """Consecutive runs of `sizes` of about `target` bytes each: (bytes, start, end) per run.

    A run closes once it holds at least `target` bytes, so every run but the last is at least
    `target`, and a run exceeds it by less than its last item.
    """
    chunks, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        total += size
        if total >= target:
            chunks.append((total, start, index + 1))
            start, total = index + 1, 0
    if start < len(sizes):
        chunks.append((total, start, len(sizes)))
    return chunks


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


def _inner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor object that holds the storage: a DTensor's own local tensor (`to_local()` would make a
    new view object when grad is enabled)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class OffloadTarget(Protocol):
    """What sleep/wake needs of the state's owner (the role engine implements it)."""

    device: torch.device

    def state_objects(self) -> list[torch.Tensor]:
        """Every tensor of the state as the owner holds it (DTensors for sharded ones)."""
        ...

    def fsdp_modules(self) -> list:
        """The FSDP2 modules whose shard views use the state's storages."""
        ...

    def prepare_to_sleep(self) -> None:
        """Reshard, drop gradients and anything else that holds device tensors outside the state."""
        ...


class StateOffloader:
    """Sleep/wake of one `OffloadTarget`'s device state (see the module docstring).

    `pack`: wake allocates the storages in few device segments (see `_packed_wake`; measured in
    docs/benchmarks.md). `coalesce_below`: storages up to this many bytes are moved into shared
    buffers at the first sleep (`coalesce`); 0 never. `small_block`: storages up to this many bytes
    move as one block (`_small_to_host`). `chunk_bytes`: a packed wake (and coalescing) reserves
    device memory in runs of about this size.
    """

    ALIGN = 512  # bytes: keeps every slot of the host buffer aligned for fast copies

    def __init__(
        self,
        engine: OffloadTarget,
        *,
        pack: bool = True,
        coalesce_below: int = _SMALL_BLOCK,
        small_block: int = _SMALL_BLOCK,
        chunk_bytes: int = _CHUNK,
    ) -> None:
        self.engine = engine
        self.pack = pack
        self.small_block = small_block
        self.coalesce_below = coalesce_below
        self.chunk_bytes = chunk_bytes
        self._coalesced_for: list[torch.UntypedStorage] | None = None
        self.last_coalesce: dict[str, int] = {"moved": 0, "rejected": 0}
        self.asleep = False
        self._buffer: torch.Tensor | None = None
        self._slots: list[_Slot] = []
        self._pool = None  # torch.cuda.MemPool for the state's storages (pack=True), made at a wake
        self._pool_chunks: tuple[int, ...] = ()
        self._cache: tuple[tuple[int, ...], list[torch.UntypedStorage], list[torch.Tensor]] | None = None
        self._plan: tuple[list[torch.UntypedStorage], int, int] | None = None  # what the layout below is for
        self._views: list[torch.Tensor] = []  # a uint8 view over each slot's storage (follows its resizes)
        self._small_count = 0
        self._small_bytes = 0
        self._small_split: list[int] = []  # sizes that split the staging buffer into slots and gaps
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ what moves

    def _state_objects(self) -> list[torch.Tensor]:
        """Every tensor of the state as the engine holds it (DTensors for sharded ones)."""
        return self.engine.state_objects()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, as local tensors (parameters, EMA, optimizer state): the objects
        that hold the storages, so holding this list does not keep `coalesce` from moving them (a
        `to_local()` view would be a holder it does not know)."""
        return [_inner(t) for t in self._state_objects()]

    def _storages(self) -> list[torch.UntypedStorage]:
        """The distinct device storages behind the state, cached while the set of state tensors is the same."""
        kind = self.engine.device.type  # one device per process: "cuda" and "cuda:0" are the same here
        objects = self._state_objects()
        key = tuple(map(id, objects))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        tensors = [t for t in map(_inner, objects) if t.device.type == kind]
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = storage
        storages = list(seen.values())
        self._cache = (key, storages, objects)  # the objects stay referenced, so their ids cannot be reused
        return storages

    # ------------------------------------------------------------------ coalescing small storages

    def _holders(self) -> dict[int, dict[int, torch.Tensor]]:
        """Every tensor object known to use a storage of the state, by storage (its C++ object): the
        state's local tensors, FSDP2's flat views of its shards, and the bases of those views."""
        tensors = [_inner(t) for t in self._state_objects()]
        for module in self.engine.fsdp_modules():
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch versions with one group per module
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            for fsdp_param in (p for group in groups for p in group.fsdp_params):
                for name in ("_sharded_param_data", "_sharded_post_forward_param_data"):
                    tensor = getattr(fsdp_param, name, None)
                    if isinstance(tensor, torch.Tensor):
                        tensors.append(tensor)
        # A view keeps its base tensor alive (FSDP2's shard views are views of one padded tensor).
        tensors += [t._base for t in tensors if t._base is not None]
        holders: dict[int, dict[int, torch.Tensor]] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                holders.setdefault(storage._cdata, {})[id(tensor)] = tensor
        return holders

    def coalesce(self) -> int:
        """Move the state's storages up to `coalesce_below` bytes into shared buffers of about
        `chunk_bytes`; returns how many storages moved (`last_coalesce` also counts those left).

        Thousands of small tensors (LoRA factors, their AdamW state) sit in the caching allocator's 2 MB
        small-block segments, hundreds of them, and returning a segment to the driver costs the same however
        small it is (a tenth of a shared-LoRA sleep on an H200: docs/benchmarks.md). Here every tensor
        object that uses such a storage is pointed (`set_`) at its bytes inside a shared buffer: same
        object, shape, strides, dtype and values; tensors that shared a storage still share their bytes.
        A storage moves only when every holder of it is known: the state's tensors and FSDP2's views of
        its shards must account for the storage's whole use count, so a reference held elsewhere (which
        would keep the old bytes) leaves that storage where it is. `sleep` calls this when the set of
        state tensors changed (the first sleep, after AdamW made its state or a checkpoint replaced it).
        Moved tensors share a storage with unrelated ones afterwards: `torch.save` of one writes the whole
        buffer, and assigning one as another parameter's data (`load_state_dict(..., assign=True)`) would
        look like the same tensor to FSDP2. Old storages are freed run by run (peak: one run extra).
        """
        if self.asleep:
            raise RuntimeError("coalesce() while asleep: call wake() first")
        try:
            moved = self._coalesce()
        finally:
            self._cache = None  # the storages changed (all, or up to a failed run); the objects did not
        self._coalesced_for = self._storages()
        return moved

    def _coalesce(self) -> int:
        limit = self.coalesce_below
        # Our own views would count as holders; the layout is remade at the next sleep.
        self._views, self._plan, self._slots = [], None, []
        self._small_count, self._small_bytes, self._small_split = 0, 0, []
        self.last_coalesce = {"moved": 0, "rejected": 0}
        small = [st for st in self._storages() if st.nbytes() <= limit] if limit else []
        if len(small) < 2:
            return 0
        holders = self._holders()
        # the holders' tensor objects, plus the one python object of the storage itself (ours)
        candidates = [(storage, list(holders.get(storage._cdata, {}).values())) for storage in small]
        movable: list[tuple[torch.UntypedStorage, list[torch.Tensor]] | None] = [
            (st, users)
            for st, users in candidates
            if users and torch._C._storage_Use_Count(st._cdata) == len(users) + 1
        ]
        del candidates
        self.last_coalesce["rejected"] = len(small) - len(movable)
        self._cache = None
        del small, holders  # from here on the old storages are referenced only by `movable` and their users
        if len(movable) < 2:
            return 0
        sizes = [-(-entry[0].nbytes() // self.ALIGN) * self.ALIGN for entry in movable]
        count = len(movable)
        with torch.no_grad():
            for total, start, end in plan_chunks(sizes, self.chunk_bytes):
                run = movable[start:end]
                shared = torch.empty(total, dtype=torch.uint8, device=self.engine.device)
                parts = torch.split(shared, sizes[start:end])
                torch._foreach_copy_(
                    [part[: entry[0].nbytes()] for part, entry in zip(parts, run, strict=True)],
                    [_bytes_of(entry[0]) for entry in run],
                )
                offset = 0
                for (_, users), size in zip(run, sizes[start:end], strict=True):
                    for tensor in users:
                        element = tensor.element_size()
                        tensor.set_(
                            shared.untyped_storage(),
                            (offset + tensor.storage_offset() * element) // element,
                            tensor.size(),
                            tensor.stride(),
                        )
                    offset += size
                del shared, parts, run
                movable[start:end] = [None] * (end - start)  # the old storages of this run are freed here
        self.last_coalesce["moved"] = count
        return count

    # ------------------------------------------------------------------ layout in the host buffer

    def _layout(self, storages: list[torch.UntypedStorage]) -> None:
        """Slots in the host buffer, views and the staging split; remade only when the storages change.

        Small storages come first, contiguous: they move as one block (see `_small_to_host`).
        """
        key = (storages, self.small_block, self.ALIGN)
        if self._plan is not None and self._plan[0] is storages and self._plan[1:] == key[1:]:
            return
        ordered = sorted(storages, key=lambda st: st.nbytes() > self.small_block)
        slots, offset = [], 0
        for storage in ordered:
            slots.append(_Slot(storage, offset, storage.nbytes()))
            offset += -(-storage.nbytes() // self.ALIGN) * self.ALIGN
        self._slots = slots
        self._views = [_bytes_of(slot.storage) for slot in slots]
        small = [slot for slot in slots if slot.nbytes <= self.small_block]
        self._small_count = len(small)
        self._small_bytes = small[-1].offset + small[-1].nbytes if small else 0
        ends = [slot.offset for slot in small[1:]] + ([self._small_bytes] if small else [])
        self._small_split = [
            size
            for slot, end in zip(small, ends, strict=True)
            for size in (slot.nbytes, end - slot.offset - slot.nbytes)
        ]
        self._plan = key

    def _small_to_host(self, cuda: bool) -> None:
        """Thousands of small tensors (LoRA factors and their AdamW state, unless coalesced) cost a copy's
        latency each, not bandwidth; they move as one block instead: gathered on the device into one
        staging buffer with a multi-tensor copy, then one copy each way (scattered back the same way at
        wake, `_small_to_device`). The staging buffer is device memory for the duration of the copy."""
        count = self._small_count
        if not count:
            return
        stage = torch.empty(self._small_bytes, dtype=torch.uint8, device=self.engine.device)
        torch._foreach_copy_(torch.split(stage, self._small_split)[::2], self._views[:count])
        self._buffer[: self._small_bytes].copy_(stage, non_blocking=cuda)
        del stage  # freed in stream order, after the copy

    def _small_to_device(self, cuda: bool) -> torch.Tensor | None:
        """The small block's bytes in a device staging buffer (queued first at wake, before the large
        storages are allocated); `_scatter_small` puts them in place once the small storages exist."""
        if not self._small_count:
            return None
        stage = torch.empty(self._small_bytes, dtype=torch.uint8, device=self.engine.device)
        stage.copy_(self._buffer[: self._small_bytes], non_blocking=cuda)
        return stage

    def _scatter_small(self, stage: torch.Tensor | None) -> None:
        if stage is not None:
            torch._foreach_copy_(self._views[: self._small_count], torch.split(stage, self._small_split)[::2])

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
        engine.prepare_to_sleep()
        coalesced, rejected = 0, 0
        if self.coalesce_below and self._storages() is not self._coalesced_for:
            coalesced, rejected = self.coalesce(), self.last_coalesce["rejected"]
        self._layout(self._storages())
        offset = self._slots[-1].offset + self._slots[-1].nbytes if self._slots else 0
        cuda = engine.device.type == "cuda"
        allocated = 0.0
        if self._buffer is None or self._buffer.numel() < offset:
            begin = time.perf_counter()
            self._buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=cuda)
            allocated = time.perf_counter() - begin
        prepared = time.perf_counter() - started
        copy_started = time.perf_counter()
        count = self._small_count
        # The large storages first: the device starts copying at once, and the host builds the small
        # block's copy while it does.
        for slot, view in zip(self._slots[count:], self._views[count:], strict=True):
            self._buffer[slot.offset : slot.offset + slot.nbytes].copy_(view, non_blocking=cuda)
            # Freeing right away is safe: the caching allocator reuses a block only for work queued after
            # this copy on the same stream; the CPU work of freeing overlaps the copies.
            slot.storage.resize_(0)
        self._small_to_host(cuda)
        for slot in self._slots[:count]:
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
                     "pinned_alloc_s": allocated, "bytes": float(self.nbytes),
                     "coalesced_storages": float(coalesced), "storages": float(len(self._slots)),
                     "coalesce_rejected": float(rejected)}  # fmt: skip
        return dict(self.last)

    def wake(self) -> dict[str, float]:
        """Give every storage its bytes back (same objects, same sizes); returns timings."""
        if not self.asleep:
            raise RuntimeError("wake() while awake: call sleep() first")
        cuda = self.engine.device.type == "cuda"
        started = time.perf_counter()
        count = self._small_count
        large = list(zip(self._slots[count:], self._views[count:], strict=True))
        stage = self._small_to_device(cuda)  # outside the pool, and queued before any large allocation

        def restore(run) -> None:
            for slot, view in run:  # allocating the next storage overlaps the copies already queued
                slot.storage.resize_(slot.nbytes)
                view.copy_(self._buffer[slot.offset : slot.offset + slot.nbytes], non_blocking=cuda)

        if cuda and self.pack and _packing_works():
            self._packed_wake(large, restore)
        else:
            restore(large)
            for slot in self._slots[:count]:
                slot.storage.resize_(slot.nbytes)
        self._scatter_small(stage)
        del stage  # freed in stream order, after the scatter
        if cuda:
            torch.cuda.synchronize(self.engine.device)
        self.asleep = False
        self.last["wake_s"] = time.perf_counter() - started  # the copies start at once: no separate part
        self.last.pop("wake_copy_s", None)
        return dict(self.last)

    def _packed_wake(self, large, restore) -> None:
        """Allocate the storages of a wake in few device segments (`pack=True`).

        Returning memory to the driver costs one `cudaFree` per segment of the caching allocator (each
        one waits for the device), not per byte (scripts/bench_release.py; docs/benchmarks.md). The storages
        of a sharded model are thousands of separate allocations, so left alone they occupy hundreds of
        segments. Here consecutive storages above the small-block size are cut from one segment of about
        `chunk_bytes`, reserved first (the allocator splits a free block to serve a smaller request),
        inside a private memory pool so that no other tensor lands in those segments and keeps them from
        being freed. The size of a run trades the two directions (measured in docs/benchmarks.md): fewer,
        larger segments free faster at sleep, but a large `cudaMalloc` at wake does not overlap the copies
        queued before it; the allocator's own small segments overlap fully but free slowly.
        The pool holds its segments until it is destroyed (`torch.cuda.empty_cache` skips a pool that is
        still referenced), so a releasing sleep drops it, and a wake makes a new one when the runs changed
        (AdamW creates its state at the first step).
        """
        device = self.engine.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        sizes = [-(-slot.nbytes // self.ALIGN) * self.ALIGN for slot, _ in large]
        chunks = plan_chunks(sizes, self.chunk_bytes)
        key = tuple(size for size, _, _ in chunks)
        if self._pool is not None and self._pool_chunks != key:
            self._pool = None  # asleep, so every block in it is free: its destructor frees the segments
        held: dict[int, torch.Tensor] = {}
        with contextlib.ExitStack() as stack:
            if self._pool is None:
                # Blocks of the state sitting free in the default pool (a first sleep with release=False)
                # go back to the driver before the pool takes the same amount again.
                torch.cuda.empty_cache()
                with torch.cuda.device(index):
                    self._pool = torch.cuda.MemPool()
                self._pool_chunks = key
                stack.enter_context(torch.cuda.use_mem_pool(self._pool, device=index))
            else:
                # The last wake's segments are free in the kept pool. Each run takes one of them whole
                # (largest first: a request takes the smallest free block that fits), so that no run
                # spills into a segment meant for a later one.
                stack.enter_context(torch.cuda.use_mem_pool(self._pool, device=index))
                for i in sorted(range(len(chunks)), key=lambda i: -chunks[i][0]):
                    held[i] = torch.empty(chunks[i][0], dtype=torch.uint8, device=device)
            for i, (size, start, end) in enumerate(chunks):
                if held.pop(i, None) is None:
                    torch.empty(
                        size, dtype=torch.uint8, device=device
                    )  # a new segment, then free in the pool
                restore(large[start:end])
            for slot in self._slots[: self._small_count]:
                slot.storage.resize_(slot.nbytes)
