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
  memory is available to other processes.
- On CPU the same steps run with an ordinary host buffer: memory is released and
  restored the same way (the identity tests run this path); it saves nothing but
  keeps one code path.

The engine must be resharded (no gathered copies alive): `sleep` does it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from verl_dmd.runtime.engine import local_tensor


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

    def __init__(self, engine) -> None:
        self.engine = engine
        self.asleep = False
        self._buffer: torch.Tensor | None = None
        self._slots: list[_Slot] = []
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ what moves

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, as local tensors (parameters, EMA, optimizer state)."""
        engine = self.engine
        tensors = [local_tensor(p) for params in engine.params.values() for p in params]
        tensors += [local_tensor(p) for p in engine.frozen_params]
        tensors += [local_tensor(t) for t in engine.independent_ema]
        for optimizer in engine.optimizers.values():
            for state in optimizer.state.values():
                tensors += [local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _storages(self) -> list[torch.UntypedStorage]:
        kind = self.engine.device.type  # one device per process: "cuda" and "cuda:0" are the same here
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in self.state_tensors():
            if tensor.device.type != kind:
                continue  # e.g. CPU-offloaded frozen weights on a GPU engine, or AdamW's CPU step counters
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = storage
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self._slots)

    # ------------------------------------------------------------------ sleep / wake

    def sleep(self) -> dict[str, float]:
        """Copy the state to host memory and free its device storage; returns timings and sizes."""
        if self.asleep:
            raise RuntimeError("sleep() while asleep: call wake() first")
        engine = self.engine
        started = time.perf_counter()
        engine.reshard()
        for role in engine.optimizers:
            engine.zero_grad(role)
        storages = self._storages()
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
        copy_started = time.perf_counter()
        for slot in slots:
            self._buffer[slot.offset : slot.offset + slot.nbytes].copy_(
                _bytes_of(slot.storage), non_blocking=cuda
            )
        if cuda:
            torch.cuda.synchronize(engine.device)
        copy_seconds = time.perf_counter() - copy_started
        for slot in slots:
            slot.storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        self.asleep = True
        self.last = {"sleep_s": time.perf_counter() - started, "sleep_copy_s": copy_seconds,
                     "pinned_alloc_s": allocated, "bytes": float(self.nbytes)}  # fmt: skip
        return dict(self.last)

    def wake(self) -> dict[str, float]:
        """Give every storage its bytes back (same objects, same sizes); returns timings."""
        if not self.asleep:
            raise RuntimeError("wake() while awake: call sleep() first")
        cuda = self.engine.device.type == "cuda"
        started = time.perf_counter()
        for slot in self._slots:
            slot.storage.resize_(slot.nbytes)
        copy_started = time.perf_counter()
        for slot in self._slots:
            _bytes_of(slot.storage).copy_(
                self._buffer[slot.offset : slot.offset + slot.nbytes], non_blocking=cuda
            )
        if cuda:
            torch.cuda.synchronize(self.engine.device)
        self.asleep = False
        self.last.update(
            {"wake_s": time.perf_counter() - started, "wake_copy_s": time.perf_counter() - copy_started}
        )
        return dict(self.last)
