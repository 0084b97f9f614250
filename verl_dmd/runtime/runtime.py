"""Phase execution: micro-batches, loss normalization, clip, one optimizer step, EMA, agreed skips.

`DistillationRoleRuntime.run_phase(request, batch)` is the unit of work one RPC
carries. Every rank runs the same sequence of collectives, so a rank that sees a
non-finite loss or gradient tells the others and all of them skip together:
no optimizer, scheduler or EMA update, gradients cleared, reason reported.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from verl_dmd import batch as batches
from verl_dmd.phases import LossNormalizerTracker, PhaseComputer, PhaseOutput, PhaseRequest, Role
from verl_dmd.runtime import sharding
from verl_dmd.runtime.engine import RoleEngine
from verl_dmd.runtime.flops import PhaseFlops


def _total_grad_norm(
    params: list[torch.nn.Parameter], device: torch.device, group=None, replicas: int = 1
) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (DTensor shards included), in float64; each shard is
    held by `replicas` ranks of `group` (a hybrid mesh's replicate size), so their summed squares are
    divided by it. When every rank holds every shard (model.fsdp_mesh=replicate, or [N, 1]) the local sum
    is the total and no collective runs (the sum reduced over N ranks, divided by N, was the same float at
    2 ranks and within a few roundings of it at more; the local sum is the exact value).

    Accumulated on `device`: NCCL reduces only device tensors.
    """
    squares = torch.zeros((), dtype=torch.float64, device=device)
    partial = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor):
            partial = partial + grad.to_local().double().square().sum()
        else:
            squares = squares + grad.double().square().sum()
    replicated = not dist.is_initialized() or replicas == dist.get_world_size(group)
    if not replicated and any(isinstance(p.grad, DTensor) for p in params):
        dist.all_reduce(partial, group=group)  # shards are disjoint within a replica: their squares add up
        if replicas > 1:
            partial = partial / replicas
    return (squares + partial).sqrt()


class ComputerView:
    """What a phase computer is handed (`verl_dmd.phases.PhaseRuntime`) and nothing more: a computer that
    reaches for anything else (the engine, optimizers, other parameters) fails with AttributeError."""

    __slots__ = ("_runtime",)

    def __init__(self, runtime: DistillationRoleRuntime) -> None:
        self._runtime = runtime

    @property
    def adapter(self):
        return self._runtime.engine.adapter

    @property
    def rank(self) -> int:
        return self._runtime.rank

    @property
    def world_size(self) -> int:
        return self._runtime.world_size

    def use_role(self, role: Role | str):
        return self._runtime.engine.use_role(role)

    def module_for(self, role: Role | str):
        return self._runtime.engine.module_for(Role(role))

    def extra_module(self, name: str):
        return self._runtime.engine.extra_module(name)


class DistillationRoleRuntime:
    """Runs phases of a `PhaseComputer` on a `RoleEngine`; no ray, no driver logic.

    `run_phase` is the sequence of the methods below it, in their order: `_prepare`
    (batch to the device, micro-batches), `_accumulate` (the computer per micro-batch,
    backward), `_normalize` (count mode), `_agree_on_skip` (gradient norm and every
    rank's non-finite flags, read back together), `_step` (clip, optimizer, scheduler),
    the EMA, and `_metrics` (one reduce, read back once).
    """

    def __init__(self, engine: RoleEngine, computer: PhaseComputer, *, group=None) -> None:
        self.engine = engine
        self.computer = computer
        self.group = group
        # The gradient norm sums every rank's shard squares over the whole group: with a hybrid mesh each shard
        # is held by `replicas` ranks, so the sum is divided by that count (one collective whose result every
        # rank reads alike, so the replicas clip alike; when every rank holds every shard, each rank's own sum of
        # its gradients, which the gradient all-reduce made bitwise equal on every rank). Every other collective
        # here is over all data-parallel ranks too.
        self.replicas = sharding.replicas(engine.mesh)
        self.plan = engine.plan
        self.view = ComputerView(self)
        self.flops = PhaseFlops(engine)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if dist.is_initialized():
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def run_phase(self, request: PhaseRequest, batch: Mapping[str, Any]) -> dict[str, Any]:
        """All micro-batches of one phase and at most one optimizer step of `request.role`."""
        started = time.perf_counter()
        role, engine = request.role, self.engine
        if engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(engine.device)
        # The record_function ranges name the parts of a phase in a torch.profiler trace
        # (scripts/trace_gaps.py charges the device's idle time to them); a few us each otherwise.
        with record_function("verl_dmd.setup"):
            micro_batches, tracker, sums = self._prepare(role, batch)
        with engine.trainable(role), engine.use_role(role):
            with self.flops.recording():
                self._accumulate(request, micro_batches, tracker, sums)
            engine.set_gradient_sync(True)
            engine.check_gradient_isolation(role)
            self._normalize(role, tracker)
            with record_function("verl_dmd.grad_norm"):
                grad_norm, skipped_reason = self._agree_on_skip(role, sums)
            with record_function("verl_dmd.step"):
                self._step(role, grad_norm, skipped_reason)
        with record_function("verl_dmd.ema"):
            if skipped_reason is None and role is Role.STUDENT:
                engine.update_ema(request.global_step + 1)
        with record_function("verl_dmd.metrics"):
            metrics = self._metrics(role, sums, len(micro_batches), grad_norm, skipped_reason)
            seconds = time.perf_counter() - started
            metrics["phase_seconds"] = seconds
        # This rank's share: the driver turns them into rates (verl_dmd.trainer.throughput).
        metrics[f"perf/{role.value}/seconds"] = seconds
        metrics[f"perf/{role.value}/samples"] = sum(batches.batch_size(m) for m in micro_batches)
        flops = self.flops.phase_flops()
        if flops is not None:
            metrics[f"perf/{role.value}/flops"] = flops
        elif self.flops.unpriced:
            metrics["perf/unpriced"] = self.flops.unpriced
        if engine.device.type == "cuda":
            metrics[f"perf/{role.value}/peak_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        return metrics

    def _prepare(self, role: Role, batch: Mapping[str, Any]):
        """The batch on the device in micro-batches, the normalizer arithmetic, the device-side sums."""
        engine = self.engine
        accumulation = getattr(self.plan.batch, role.value).accumulation_steps
        batch = batches.to_device(dict(batch), engine.device)
        if batches.batch_size(batch) is None:
            raise ValueError("a phase batch must hold at least one tensor with a batch dimension")
        micro_batches = batches.split(
            batch, accumulation, what="micro-batches",
            fix=f"lower batch.{role.value}.accumulation_steps or send more samples per rank",
        )  # fmt: skip
        # Sums stay on the device: reading a value back (.item()) waits for the GPU, and each wait
        # leaves it idle until the host queues the next kernels. A phase reads back three times
        # (twice on one rank).
        sums = _PhaseSums(torch.zeros((), dtype=torch.float64, device=engine.device), {}, {})
        engine.verify_layout()
        engine.zero_grad(role)
        return micro_batches, LossNormalizerTracker(len(micro_batches)), sums

    def _accumulate(self, request: PhaseRequest, micro_batches, tracker, sums: _PhaseSums) -> None:
        """The computer on every micro-batch, each loss backpropagated with its weight; the gradients are
        reduce-scattered on the last micro-batch only (TRAPS: set_requires_gradient_sync)."""
        engine, device = self.engine, self.engine.device
        for index, micro_batch in enumerate(micro_batches):
            with record_function("verl_dmd.compute"):
                engine.set_gradient_sync(index == len(micro_batches) - 1)
                output = self.computer.compute_phase(
                    request,
                    micro_batch,
                    self.view,
                    micro_batch_index=index,
                    num_micro_batches=len(micro_batches),
                )
                if not isinstance(output, PhaseOutput):
                    raise TypeError(
                        f"compute_phase returned {type(output).__name__}: must return a PhaseOutput"
                    )
                weight = tracker.loss_weight(output.loss_normalizer)
                # float32, then float64, summed in float64: what float(loss) summed in Python gives.
                sums.loss = sums.loss + output.loss.detach().float().to(device, torch.float64)
                for key, value in output.metrics.items():
                    if isinstance(value, torch.Tensor):  # summed in float64 like the python floats
                        value = value.to(device, torch.float64)
                    sums.metrics[key] = sums.metrics.get(key, 0.0) + value
                    sums.counts[key] = sums.counts.get(key, 0) + 1
                if output.loss.requires_grad:
                    (output.loss * weight).backward()

    def _normalize(self, role: Role, tracker: LossNormalizerTracker) -> None:
        """Count mode: divide the gradients by the data-parallel mean count (mean mode: nothing to do)."""
        if tracker.mode != "count":
            return
        count = self._all_reduce(
            torch.tensor([tracker.local_count], dtype=torch.float64, device=self.engine.device)
        )
        divisor = tracker.gradient_divisor(count.item() / self.world_size)
        with torch.no_grad():
            for p in self.engine.params[role]:
                if p.grad is not None:
                    p.grad.div_(divisor)

    def _agree_on_skip(self, role: Role, sums: _PhaseSums) -> tuple[float, str | None]:
        """The global gradient norm, and why every rank skips the step (None: it steps).

        One collective tells every rank which ranks saw a non-finite loss (a non-finite term makes the
        sum non-finite); the norm is global already. Both are read back in one wait.
        """
        device = self.engine.device
        norm = _total_grad_norm(self.engine.params[role], device, self.group, self.replicas)
        flags = torch.zeros(self.world_size, dtype=torch.float64, device=device)
        flags[self.rank] = (~torch.isfinite(sums.loss)).to(torch.float64)
        *flag_values, grad_norm = torch.cat([self._all_reduce(flags), norm.reshape(1)]).tolist()
        bad_ranks = [r for r, flag in enumerate(flag_values) if flag > 0]
        if bad_ranks:
            return grad_norm, f"non-finite loss on rank(s) {bad_ranks}"
        if not math.isfinite(grad_norm):
            return grad_norm, f"non-finite gradient norm ({grad_norm})"
        return grad_norm, None

    def _step(self, role: Role, grad_norm: float, skipped_reason: str | None) -> None:
        """Clip, one optimizer step and one scheduler step, unless skipped; the gradients are cleared."""
        engine = self.engine
        if skipped_reason is None:
            clip = getattr(self.plan.optim, role.value).grad_clip
            if clip > 0 and grad_norm > clip:
                scale = clip / (grad_norm + 1e-6)
                with torch.no_grad():
                    for p in engine.params[role]:
                        if p.grad is not None:
                            p.grad.mul_(scale)
            engine.optimizer_step(role)
            engine.schedulers[role].step()
        engine.zero_grad(role)

    def _metrics(
        self,
        role: Role,
        sums: _PhaseSums,
        num_micro_batches: int,
        grad_norm: float,
        skipped_reason: str | None,
    ) -> dict[str, Any]:
        """The same metrics on every rank: the loss averaged over micro-batches and ranks, each of the
        computer's metrics over the micro-batches (of every rank) that reported it.

        Metrics are averaged by position, so every rank must report the same keys in the same order. A
        fixed-size reduce of (key count, CRC of the keys) checks that first: reducing tensors of different
        lengths would hang. A second reduce beside the values' counts each metric's reports. Every rank sees the
        same sums and raises alike. One rank cannot disagree with itself: no check, and one wait for the device less.
        """
        device, metric_sums = self.engine.device, sums.metrics
        key_crc = float(zlib.crc32("\n".join(metric_sums).encode()))
        if self.world_size > 1 and self._all_reduce(
            torch.tensor([len(metric_sums), key_crc], dtype=torch.float64, device=device)
        ).tolist() != [len(metric_sums) * self.world_size, key_crc * self.world_size]:
            raise RuntimeError(
                f"ranks reported different metric keys in a {role.value} phase (rank {self.rank}, in the "
                f"order of first report: {list(metric_sums)}); a phase computer must return the same metrics "
                "on every rank, first reported in the same order"
            )
        values = [sums.loss / num_micro_batches, *metric_sums.values()]
        stacked = torch.stack([
            v.to(device, torch.float64).reshape(()) if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=torch.float64, device=device)  # a fill, not a host copy
            for v in values
        ])  # fmt: skip
        # the counts in a buffer of their own: a longer values buffer would change how a reduce over more
        # than two ranks chunks it, and so the order in which it adds the values
        parts = [self._all_reduce(stacked)]
        if metric_sums:
            counts = [float(sums.counts[key]) for key in metric_sums]
            parts.append(self._all_reduce(torch.tensor(counts, dtype=torch.float64, device=device)))
        reduced = (torch.cat(parts) / self.world_size).tolist()  # one wait for the device
        mean, reports = reduced[: len(values)], reduced[len(values) :]
        # (sum over ranks / ranks) / (reports over ranks / ranks): for a metric that every micro-batch
        # reported, (sum / ranks) / micro-batches, the mean as before
        metrics: dict[str, Any] = {
            f"{role.value}/{k}": v / n for k, v, n in zip(metric_sums, mean[1:], reports, strict=True)
        }
        metrics.update(
            {
                f"{role.value}/loss": mean[0],
                f"{role.value}/grad_norm": grad_norm,
                f"{role.value}/lr": self.engine.optimizers[role].param_groups[0]["lr"],
                "stepped": skipped_reason is None,
                "skipped_reason": skipped_reason,
            }
        )
        return metrics


@dataclass
class _PhaseSums:
    """A phase's running sums on the device: the loss and each metric of the computer."""

    loss: torch.Tensor
    metrics: dict[str, Any]
    counts: dict[str, int]
    """How many micro-batches reported each metric (a computer may report a metric in some only)."""
