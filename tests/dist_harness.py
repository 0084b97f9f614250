"""Spawn N gloo ranks running a module-level function; collect what each rank returns."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, workdir: str, args: tuple, environ: dict, cwd: str) -> None:
    # A forked rank has the fork server's environment and directory, taken when the server started: the
    # test's own are the ones that count.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
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


# What every rank imports, loaded once by the fork server; ranks are forked from it with the modules in
# place (importing torch, peft and diffusers takes a rank 10-20 s of CPU on the 2-core CI machine, and the
# suite starts ranks some 40 times). The server imports and runs nothing else: a rank still starts with no
# state of any earlier rank or test, as a spawned one does.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "peft", "diffusers",
    "verl_dmd.adapters", "verl_dmd.adapters.diffusers_transformers", "verl_dmd.algorithms.dmd2",
    "verl_dmd.runtime.engine", "verl_dmd.runtime.runtime", "verl_dmd.checkpoint.composite",
]  # fmt: skip


def _context():
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_ranks(fn, world_size: int, workdir: Path, *args: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh gloo ranks (forked from a server that holds
    the imports, `PRELOAD`); return their results.

    `fn` must live in an importable module. An exception on any rank fails the call.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    _context()
    mp.start_processes(
        _entry,
        args=(fn, world_size, str(workdir), args, dict(os.environ), os.getcwd()),
        nprocs=world_size,
        start_method="forkserver",
    )
    return [torch.load(workdir / f"result_{r}.pt", weights_only=True) for r in range(world_size)]
