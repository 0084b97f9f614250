"""`DiffusionDistillationWorker`: the verl worker that holds one rank's `RankSession`.

Ray pickles this class by reference, so it lives in an importable module
(TRAPS.md). verl sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
worker's environment; `init_model` joins the process group from them (gloo on
CPU, nccl on GPU) and builds the session. Every method is registered with
``blocking=False``: the driver-side group (`verl_dmd.workers.group`) waits on
the per-rank futures itself, so it can name the rank that failed and enforce
``trainer.rpc_timeout_s``.

Two dispatch modes:

- broadcast (verl's ``ONE_TO_ALL``): every rank gets the same arguments;
- ``SPLIT``: tensors (also inside dicts and lists) are split along dim 0 into
  one contiguous part per rank; other arguments are broadcast. The driver sends
  batches whose size is a multiple of the world size.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


def split_for_ranks(value: Any, parts: int) -> list[Any]:
    """`value` split into `parts` contiguous pieces along dim 0 (recursing into dicts and lists)."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 or value.shape[0] % parts:
            raise ValueError(
                f"a tensor of shape {tuple(value.shape)} does not split into {parts} equal parts"
            )
        return list(torch.tensor_split(value, parts))
    if isinstance(value, dict):
        pieces = {k: split_for_ranks(v, parts) for k, v in value.items()}
        return [{k: pieces[k][r] for k in value} for r in range(parts)]
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        pieces = [split_for_ranks(v, parts) for v in value]
        return [[p[r] for p in pieces] for r in range(parts)]
    return [value] * parts


def _dispatch_split(worker_group, *args, **kwargs):
    parts = worker_group.world_size
    return (
        tuple(split_for_ranks(a, parts) for a in args),
        {k: split_for_ranks(v, parts) for k, v in kwargs.items()},
    )


def _collect_per_rank(worker_group, output):
    return output


SPLIT = {"dispatch_fn": _dispatch_split, "collect_fn": _collect_per_rank}


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
    """One rank of a distillation run: builds its `RankSession` from the plan's config mapping."""

    def __init__(self, plan_config: dict[str, Any]) -> None:
        super().__init__()
        self._plan_config = plan_config
        self.session = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def init_model(self) -> dict[str, Any]:
        import os

        import torch.distributed as dist

        from verl_dmd.plan import DistillationPlan
        from verl_dmd.workers.session import RankSession, resolve_device

        plan = DistillationPlan.from_config(self._plan_config)
        _ignore_stop_signals()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = resolve_device(plan, local_rank)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=plan.trainer.rpc_timeout_s),
            )
        self.session = RankSession(plan, rank=self.rank, world_size=self.world_size, device=device)
        return self.session.describe()

    @register(dispatch_mode=SPLIT, blocking=False)
    def run_phase(self, request, batch):
        return self.session.run_phase(request, batch)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def save_checkpoint(self, global_step: int, trainer_state: dict[str, Any]) -> str:
        return self.session.save_checkpoint(global_step, trainer_state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load_checkpoint(self):
        return self.session.load_checkpoint()

    @register(dispatch_mode=SPLIT, blocking=False)
    def euler(self, role, noise, cond, steps, guidance=1.0, uncond=None, chunk=512):
        return self.session.euler(role, noise, cond, steps, guidance, uncond, chunk)

    @register(dispatch_mode=SPLIT, blocking=False)
    def few_step(self, role, noise, cond, schedule, renoise):
        return self.session.few_step(role, noise, cond, schedule, renoise)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self) -> dict:
        return self.session.sleep()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def wake(self) -> dict:
        return self.session.wake()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def shutdown(self) -> None:
        import gc

        import torch.distributed as dist

        # Free the models first: their DTensors hold the process group through the device mesh, and
        # a group that outlives destroy_process_group until interpreter exit can abort the process
        # ("terminate called without an active exception", seen in 2-rank gloo tests).
        self.session = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
