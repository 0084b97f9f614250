"""Spawn N gloo ranks running a module-level function; collect what each rank returns."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))
    finally:
        # Objects of the scenario (sharded models) hold the group through their device mesh; freed only
        # at interpreter exit, after destroy_process_group, they aborted ranks now and then.
        gc.collect()
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, workdir: Path, *args: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return their results.

    `fn` must live in an importable module. An exception on any rank fails the call.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _entry, args=(fn, world_size, str(workdir), args), nprocs=world_size, start_method="spawn"
    )
    return [torch.load(workdir / f"result_{r}.pt", weights_only=True) for r in range(world_size)]
