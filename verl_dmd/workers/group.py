"""The driver's view of the ranks: one blocking call per operation, per-rank results, named failures.

`WorkerGroup` writes every operation of `verl_dmd.workers.operations` once, over
one `_call(method, ...)` that its two kinds implement:

- `DiffusionDistillationWorkerGroup`: ray actors through verl's
  `RayResourcePool` / `RayWorkerGroup` (on CPU: ``use_gpu=False``,
  ``max_colocate_count=1``, TRAPS.md). The actors' start is waited for first,
  with a deadline of its own. Each call waits on every rank's future
  with ``trainer.rpc_timeout_s``; the first rank that raises ends the call with
  `WorkerError` naming the rank and the original exception, a rank that dies is
  named too, and ranks that do not answer in time end it with `WorkerTimeout`.
  A timeout names the rank(s) that stopped answering first (their stack is not
  inside torch.distributed) apart from those waiting for them in a collective,
  with what each was doing (the operation; for a phase its index and role), and
  writes every rank's status header and Python stack (dumped by the rank itself
  shortly before the deadline, `verl_dmd.workers.status`) to
  ``<output_dir>/hang-<time>.txt``, whose path the message gives; all within
  the timeout plus `verl_dmd.workers.status.REPORT_WAIT_S`. After any of these
  the group kills its actors (a surviving rank may be stuck in a collective with
  the failed one).
- `LocalWorkerGroup`: one rank in this process (a gloo group on an in-process
  store), the same interface without ray: tests, debugging, and single-GPU runs.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from verl_dmd import batch as batches
from verl_dmd.workers import status
from verl_dmd.workers.operations import OPERATIONS, rank_arguments

START_TIMEOUT_S = 600.0
"""The least time the actors get to start (process, imports, __init__), whatever trainer.rpc_timeout_s says:
a short call deadline (set to see hangs early) must not fail a start on a busy machine."""


class WorkerError(RuntimeError):
    """A worker call failed on a rank; the message names the rank and the original error."""


class WorkerTimeout(WorkerError):
    """A worker call was not answered by every rank within trainer.rpc_timeout_s."""


def _last_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else ""


class WorkerGroup:
    """The operations, written once; `_call(method, *args, **kwargs)` returns one result per rank."""

    world_size: int

    def _call(self, method: str, *args, **kwargs) -> list[Any]:
        raise NotImplementedError

    def init_model(self) -> list:
        """Build every rank's session; each rank's `WorkerInfo`."""
        return self._call("init_model")

    def run_phase(self, request, batch) -> list[dict[str, Any]]:
        """One phase on every rank (the batch split over them); each rank's metrics."""
        return self._call("run_phase", request, batch)

    def save_checkpoint(self, global_step: int, trainer_state: dict[str, Any]) -> str:
        """Publish the checkpoint of `global_step`; its directory."""
        return self._call("save_checkpoint", global_step, trainer_state)[0]

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Resolve checkpoint.resume and load it; the driver's part of the state, or None (a fresh start)."""
        return self._call("load_checkpoint")[0]

    def sleep(self) -> list[dict[str, float]]:
        """Every rank's state to host memory (see verl_dmd.runtime.offload); per-rank timings."""
        return self._call("sleep")

    def wake(self) -> list[dict[str, float]]:
        return self._call("wake")

    def euler(
        self, role, noise, cond, steps, *, guidance=1.0, uncond=None, chunk=512, shift=1.0
    ) -> torch.Tensor:
        """Euler samples of `role` (the teacher's ODE sampler), the batch split over the ranks."""
        tensors = {"noise": noise, "cond": cond, **({"uncond": uncond} if uncond is not None else {})}
        return self._split_call("euler", tensors, {"role": role, "steps": steps, "guidance": guidance,
                                                    "chunk": chunk, "shift": shift})  # fmt: skip

    def few_step(self, role, noise, cond, schedule, renoise) -> torch.Tensor:
        """Few-step samples of `role` with pre-drawn re-noising, the batch split over the ranks."""
        tensors = {"noise": noise, "cond": cond, "renoise": list(renoise)}
        return self._split_call("few_step", tensors, {"role": role, "schedule": [float(s) for s in schedule]})

    def decode(self, latents: torch.Tensor, *, height: int, width: int) -> torch.Tensor:
        """Latents decoded by the teacher pipeline's VAE into uint8 RGB, (B, H, W, 3) or (B, F, H, W, 3), the
        batch split over the ranks."""
        return self._split_call("decode", {"latents": latents}, {"height": height, "width": width})

    def sync_replica(self, role: str, *, components: tuple[str, ...] = ("transformer",), blend: float | None = None
                     ) -> dict[str, Any]:  # fmt: skip
        """Publish `role`'s weights to the inference replica (rank 0's; `RankSession.sync_replica`): the new
        version, seconds and peak bytes."""
        return self._call("sync_replica", role, tuple(components), blend)[0]

    def replica_few_step(self, noise, cond, schedule, renoise) -> tuple[torch.Tensor, str]:
        """Few-step samples by the replica (rank 0 samples the whole batch) and the transformer version."""
        out = self._call("replica_few_step", noise, cond, [float(s) for s in schedule], list(renoise))[0]
        return out["samples"], out["version"]

    def replica_state(self) -> dict[str, Any]:
        return self._call("replica_state")[0]

    def _split_call(self, method: str, tensors: dict[str, Any], rest: dict[str, Any]) -> torch.Tensor:
        """A sampling call padded to a multiple of the world size; the samples in order, padding trimmed."""
        padded, pad = batches.pad_to_multiple(tensors, self.world_size)
        return batches.trim(torch.cat(self._call(method, **padded, **rest)), pad)

    def kill(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class DiffusionDistillationWorkerGroup(WorkerGroup):
    """`world_size` ray workers (``resources.nnodes`` x ``resources.workers_per_node``) for one plan."""

    def __init__(self, plan, *, worker_cls=None, device: str = "cpu") -> None:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        from verl_dmd.workers.worker import DiffusionDistillationWorker

        self.plan = plan
        self.world_size = plan.resources.world_size
        self.timeout = plan.trainer.rpc_timeout_s
        # As the driver sees it: a worker's working directory need not be the driver's.
        self.output_dir = Path(plan.trainer.output_dir).resolve()
        self.status_dir = status.status_dir(self.output_dir)
        self._clear_status_files()
        use_gpu = device == "cuda"
        # verl waits for the placement group without a deadline: a request the cluster cannot hold
        # would hang silently, so compare first.
        have = ray.cluster_resources()
        want = {"GPU" if use_gpu else "CPU": float(self.world_size)}
        for kind, amount in want.items():
            if have.get(kind, 0.0) < amount:
                raise WorkerError(
                    f"config key 'resources.workers_per_node' x 'resources.nnodes' = {self.world_size} workers "
                    f"need {amount:g} {kind}(s), the ray cluster has {have.get(kind, 0.0):g}; fix: lower "
                    "resources.workers_per_node / resources.nnodes, or add nodes to the cluster"
                )
        pool = RayResourcePool(
            process_on_nodes=[plan.resources.workers_per_node] * plan.resources.nnodes,
            use_gpu=use_gpu,
            max_colocate_count=1,  # the default 10 asks for 10 CPUs per bundle: a hang on small machines
        )
        cls = ray.remote(worker_cls or DiffusionDistillationWorker)
        # The models' content digests go with the plan: no worker hashes a model to know the fingerprint.
        config = plan.with_model_contents().to_dict()
        self.group = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(
                cls=cls, plan_config=config, status_dir=str(self.status_dir)
            ),
            device_name="cuda" if use_gpu else "cpu",
        )
        self._closed = False
        # The actors' start gets a deadline of its own: on a busy machine it can take a good part of a short
        # trainer.rpc_timeout_s, which init_model's deadline would otherwise include.
        ready = [worker.__ray_ready__.remote() for worker in self.group.workers]
        self._wait("start", ready, timeout=max(self.timeout, START_TIMEOUT_S))

    def _clear_status_files(self) -> None:
        """Remove the status files of an earlier run in this output directory: a rank that never starts
        must not be reported with another run's stack."""
        with contextlib.suppress(OSError):
            for path in self.status_dir.glob("rank_*.txt"):
                path.unlink(missing_ok=True)

    def _call(self, method: str, *args, **kwargs) -> list[Any]:
        if self._closed:
            raise WorkerError(f"call {method}: the worker group was shut down after an earlier failure")
        futures = getattr(self.group, method)(*args, **kwargs)
        return self._wait(method, futures)

    def _wait(self, method: str, futures: list, *, timeout: float | None = None) -> list[Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        index = {ref: rank for rank, ref in enumerate(futures)}
        results: dict[int, Any] = {}
        pending = list(futures)
        sent = time.time()
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, remaining))
            if not ready:
                late = sorted(index[ref] for ref in pending)
                if method in OPERATIONS:
                    message = self._timeout_report(method, late, sent)
                else:  # the actors' start: no operation ran, so there is no status to read
                    message = (f"worker {method}: rank(s) {late} did not start within {timeout:g} s; the "
                               "workers were stopped")  # fmt: skip
                self.kill()  # only now: the late ranks dumped their stacks themselves, before the deadline
                raise WorkerTimeout(message)
            for ref in ready:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except RayTaskError as err:
                    cause = err.cause if getattr(err, "cause", None) is not None else err
                    self.kill()
                    raise WorkerError(
                        f"worker call {method} failed on rank {rank}: {type(cause).__name__}: {_last_line(cause)}"
                    ) from cause
                except RayActorError as err:
                    self.kill()
                    raise WorkerError(
                        f"worker call {method}: rank {rank} died ({type(err).__name__})"
                    ) from err
                except GetTimeoutError:
                    self.kill()
                    raise WorkerTimeout(f"worker call {method}: rank {rank} timed out") from None
        return [results[r] for r in range(len(futures))]

    def _timeout_report(self, method: str, late: list[int], sent: float) -> str:
        """The one-line error of a call that `late` did not answer in time; every rank's status and stack
        go to ``<output_dir>/hang-<time>.txt`` (waiting at most REPORT_WAIT_S for the late ranks' dumps)."""
        reports = status.read_reports(
            self.status_dir, range(self.world_size), late, method=method, sent=sent,
            until=time.monotonic() + status.REPORT_WAIT_S,
        )  # fmt: skip
        path = self.output_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        message = status.timeout_message(method, self.timeout, late, reports, str(path), sent=sent)
        try:
            status.write_log(
                path, message, reports, late, method=method, sent=sent, directory=self.status_dir
            )
        except OSError as err:
            message = status.timeout_message(
                method, self.timeout, late, reports, f"not written ({path}: {err.strerror or err})", sent=sent
            )
        return message

    def kill(self) -> None:
        import ray

        self._closed = True
        for worker in getattr(self.group, "_workers", []):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(worker, no_restart=True)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._call("shutdown")
        finally:
            self.kill()


class LocalWorkerGroup(WorkerGroup):
    """One rank in this process: the same calls as the ray group, without ray."""

    world_size = 1

    def __init__(self, plan, *, device: str = "cpu") -> None:
        import torch.distributed as dist

        self.plan = plan
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            # An in-process store: no port, so concurrent runs never collide.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._device = device
        self.session = None

    def _call(self, method: str, *args, **kwargs) -> list[Any]:
        """Run `method` as rank 0 (the session's, except building it); errors come back as the ray group's do."""
        if method not in OPERATIONS:
            raise AttributeError(f"{method!r} is not a worker operation")
        (args, kwargs) = rank_arguments(OPERATIONS[method], args, kwargs, 1)
        args, kwargs = tuple(a[0] for a in args), {k: v[0] for k, v in kwargs.items()}
        try:
            if method == "init_model":
                from verl_dmd.workers.session import RankSession

                self.session = RankSession(self.plan, rank=0, world_size=1, device=self._device)
                return [self.session.describe()]
            if method == "shutdown":
                self.close()
                return [None]
            return [getattr(self.session, method)(*args, **kwargs)]
        except Exception as err:
            raise WorkerError(
                f"worker call {method} failed on rank 0: {type(err).__name__}: {_last_line(err)}"
            ) from err

    def kill(self) -> None:
        self.close()

    def close(self) -> None:
        import gc

        import torch.distributed as dist

        if self.session is not None:
            self.session.close()
        self.session = None  # the models hold the group (see DiffusionDistillationWorker.shutdown)
        gc.collect()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
