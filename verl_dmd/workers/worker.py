"""`DiffusionDistillationWorker`: the verl worker that holds one rank's `RankSession`.

Ray pickles this class by reference, so it lives in an importable module
(TRAPS.md). verl sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
worker's environment; `init_model` joins the process group from them (gloo on
CPU, nccl on GPU) and builds the session. The other operations of
`verl_dmd.workers.operations.OPERATIONS` are registered from that table as
forwards to the session's methods, each with its dispatch and ``blocking=False``:
the driver-side group (`verl_dmd.workers.group`) waits on the per-rank futures
itself, so it can name the rank that failed and enforce ``trainer.rpc_timeout_s``.

Every operation, a subclass's override included (`operation` wraps it), runs
inside `verl_dmd.workers.status.RankStatus.watch`: the rank's status file
(``<output_dir>/.ranks/rank_<r>.txt``, or the ``status_dir`` the group passes)
gets a header (rank, pid, operation, the request, the start time) and, if the
operation is still running shortly before ``trainer.rpc_timeout_s``, every
thread's stack from ``faulthandler``; the driver reads them when a call times out.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import register

from verl_dmd.runtime.sharding import PROCESS_GROUP_GRACE_S  # the world group's and the mesh's
from verl_dmd.workers import status
from verl_dmd.workers.operations import OPERATIONS, Dispatch, rank_arguments


def _dispatch_mode(dispatch: Dispatch) -> dict:
    """A verl dispatch mode: our argument split, and the per-rank results as they come."""

    def dispatch_fn(worker_group, *args, **kwargs):
        return rank_arguments(dispatch, args, kwargs, worker_group.world_size)

    def collect_fn(worker_group, output):
        return output

    return {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def operation(name: str):
    """verl's registration of operation `name` (its dispatch, non-blocking), run inside the rank's status
    watch; a subclass that overrides an operation decorates its method with it (``@operation("run_phase")``)."""
    registration = register(dispatch_mode=_dispatch_mode(OPERATIONS[name]), blocking=False)

    def decorate(method):
        @functools.wraps(method)
        def watched(self, *args, **kwargs):
            rank_status = getattr(self, "_rank_status", None)
            if rank_status is None:  # no status file (see RankStatus.open)
                return method(self, *args, **kwargs)
            with rank_status.watch(name, args, kwargs):
                return method(self, *args, **kwargs)

        return registration(watched)

    return decorate


def _ignore_stop_signals() -> None:
    """Workers ignore SIGTERM and SIGINT: the driver finishes the phase, saves and stops them.

    Schedulers (Slurm, `timeout`, `kill -- -PGID`, Ctrl-C) signal every process of a job; ray's
    own worker handler would exit mid-phase and lose the checkpoint the driver is about to write.
    The driver kills its workers itself (ray.kill) when it stops or fails.
    """
    import contextlib
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signum, signal.SIG_IGN)


class DiffusionDistillationWorker(Worker):
    """One rank of a distillation run: builds its `RankSession` from the plan's config mapping.

    `status_dir` is where this rank's status file goes (the group passes the absolute
    ``<output_dir>/.ranks`` as the driver resolves it); None derives it from trainer.output_dir.
    """

    def __init__(self, plan_config: dict[str, Any], status_dir: str | None = None) -> None:
        super().__init__()
        self._plan_config = plan_config
        self.session = None
        trainer = plan_config["trainer"]
        directory = Path(status_dir) if status_dir else status.status_dir(trainer["output_dir"])
        self._rank_status = status.RankStatus.open(
            status.status_file(directory, self.rank), rank=self.rank, timeout=float(trainer["rpc_timeout_s"])
        )

    @operation("init_model")
    def init_model(self):
        import os

        import torch.distributed as dist

        from verl_dmd.plan import DistillationPlan
        from verl_dmd.workers.session import RankSession, resolve_device

        plan = DistillationPlan.from_config(self._plan_config)
        _ignore_stop_signals()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = resolve_device(plan, local_rank)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        started = time.perf_counter()
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=plan.trainer.rpc_timeout_s + PROCESS_GROUP_GRACE_S),
            )
        joined = time.perf_counter() - started
        self.session = RankSession(plan, rank=self.rank, world_size=self.world_size, device=device)
        self.session.init_seconds = {"process group": joined, **self.session.init_seconds}
        return self.session.describe()

    @operation("shutdown")
    def shutdown(self) -> None:
        import gc

        import torch.distributed as dist

        # Free the models first: their DTensors hold the process group through the device mesh, and
        # a group that outlives destroy_process_group until interpreter exit can abort the process
        # ("terminate called without an active exception", seen in 2-rank gloo tests).
        if self.session is not None:
            self.session.close()
        self.session = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _forward(name: str):
    def forward(self, *args, **kwargs):
        return getattr(self.session, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"RankSession.{name} on this rank."
    return forward


# The session's operations, registered from the one table (ray binds registered methods by scanning the
# class, so methods set here count as written in the class body).
for _name in OPERATIONS:
    if _name not in vars(DiffusionDistillationWorker):
        setattr(DiffusionDistillationWorker, _name, operation(_name)(_forward(_name)))
del _name
