"""Spawn N gloo ranks running a module-level function; collect what each rank returns."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
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
    # SIGUSR1 writes every thread's stack to stacks_<rank>.txt (run_ranks asks for it when a run is
    # cut short); a collective that waits COLLECTIVE_TIMEOUT for a peer raises instead of spinning.
    stacks = open(os.path.join(workdir, f"stacks_{rank}.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))
    except BaseException:
        Path(workdir, f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
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


COLLECTIVE_TIMEOUT = timedelta(seconds=150)
"""How long a rank waits in one collective (gloo's default is 30 minutes); well under the tests' 300 s."""


def _dump_stacks(workdir: Path, processes) -> None:
    """Every live rank's stacks, to stderr (shown with the failing test)."""
    alive = [(rank, p) for rank, p in enumerate(processes) if p.exitcode is None]
    for _, process in alive:
        with contextlib.suppress(ProcessLookupError):  # (it may have exited since)
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(1.0)
    for rank, process in alive:
        path = workdir / f"stacks_{rank}.txt"
        text = path.read_text() if path.exists() else "(no stacks written)"
        print(f"--- rank {rank} (pid {process.pid}) still running; its stacks:\n{text}", file=sys.stderr)


def _context():
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_ranks(fn, world_size: int, workdir: Path, *args: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh gloo ranks (forked from a server that holds
    the imports, `PRELOAD`); return their results.

    `fn` must live in an importable module. An exception on any rank fails the call with the traceback of
    the first rank that failed; a test timeout raised while it waits prints where each live rank is; no
    rank outlives the call.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    _context()
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, str(workdir), args, dict(os.environ), os.getcwd()),
        nprocs=world_size,
        start_method="forkserver",
        join=False,
    )
    processes = context.processes
    failed = None
    try:
        # The first rank to fail is the one reported (the others fail after it, for want of a peer).
        while failed is None and any(p.exitcode is None for p in processes):
            multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=5)
            failed = next((rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)), None)
    except BaseException:  # the test's timeout, raised in this frame: where each live rank waits
        _dump_stacks(workdir, processes)
        raise
    finally:  # no rank outlives its test
        for process in processes:
            if process.exitcode is None:
                process.kill()
                process.join(5)
    if failed is not None:
        error = workdir / f"error_{failed}.txt"
        detail = error.read_text() if error.exists() else f"exit code {processes[failed].exitcode}"
        raise RuntimeError(f"rank {failed} of {world_size} failed first:\n{detail}")
    return [torch.load(workdir / f"result_{r}.pt", weights_only=True) for r in range(world_size)]
