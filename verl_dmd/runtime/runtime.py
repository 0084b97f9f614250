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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from verl_dmd.phases import LossNormalizerTracker, PhaseComputer, PhaseOutput, PhaseRequest, Role
from verl_dmd.runtime.engine import RoleEngine


def split_batch(batch: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split every tensor of a batch mapping along dim 0 into `parts` non-empty micro-batches."""
    sizes = {key: value.shape[0] for key, value in batch.items() if isinstance(value, torch.Tensor)}
    if not sizes:
        raise ValueError("a phase batch must hold at least one tensor with a batch dimension")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the batch size: {sizes}")
    size = next(iter(sizes.values()))
    if size < parts:
        raise ValueError(
            f"a batch of {size} samples cannot fill {parts} micro-batches; "
            "fix: lower batch.<role>.accumulation_steps or send more samples per rank"
        )
    chunks: list[dict[str, Any]] = [{} for _ in range(parts)]
    for key, value in batch.items():
        pieces = torch.tensor_split(value, parts) if isinstance(value, torch.Tensor) else [value] * parts
        for chunk, piece in zip(chunks, pieces, strict=True):
            chunk[key] = piece
    return chunks


def _total_grad_norm(params: list[torch.nn.Parameter], device: torch.device, group=None) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (DTensor shards included), in float64.

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
    if dist.is_initialized() and any(isinstance(p.grad, DTensor) for p in params):
        dist.all_reduce(partial, group=group)  # shards are disjoint: their squares add up
    return (squares + partial).sqrt()


class DistillationRoleRuntime:
    """Runs phases of a `PhaseComputer` on a `RoleEngine`; no ray, no driver logic."""

    def __init__(self, engine: RoleEngine, computer: PhaseComputer, *, group=None) -> None:
        self.engine = engine
        self.computer = computer
        self.group = group
        self.plan = engine.plan

    # The computer enters frozen roles through the runtime (DMD2.md, phase computer contract).
    def use_role(self, role: Role | str):
        return self.engine.use_role(role)

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
        role = request.role
        engine = self.engine
        batch_spec = getattr(self.plan.batch, role.value)
        device = engine.device
        # The record_function ranges name the parts of a phase in a torch.profiler trace
        # (scripts/trace_gaps.py charges the device's idle time to them); a few us each otherwise.
        with record_function("verl_dmd.setup"):
            batch = {
                k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()
            }
            micro_batches = split_batch(batch, batch_spec.accumulation_steps)
            tracker = LossNormalizerTracker(len(micro_batches))
            optim_spec = getattr(self.plan.optim, role.value)
            # Sums stay on the device: reading a value back (.item()) waits for the GPU, and each wait
            # leaves it idle until the host queues the next kernels. A phase reads back three times
            # (twice on one rank).
            metric_sums: dict[str, Any] = {}
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            engine.verify_layout()
            engine.zero_grad(role)
        with engine.trainable(role), engine.use_role(role):
            for index, micro_batch in enumerate(micro_batches):
                with record_function("verl_dmd.compute"):
                    # Reduce-scatter only on the last micro-batch (TRAPS: set_requires_gradient_sync).
                    engine.set_gradient_sync(index == len(micro_batches) - 1)
                    output = self.computer.compute_phase(
                        request,
                        micro_batch,
                        self,
                        micro_batch_index=index,
                        num_micro_batches=len(micro_batches),
                    )
                    if not isinstance(output, PhaseOutput):
                        raise TypeError(
                            f"compute_phase returned {type(output).__name__}: must return a PhaseOutput"
                        )
                    weight = tracker.loss_weight(output.loss_normalizer)
                    # float32, then float64, summed in float64: what float(loss) summed in Python gives.
                    loss_sum = loss_sum + output.loss.detach().float().to(device, torch.float64)
                    for key, value in output.metrics.items():
                        if isinstance(value, torch.Tensor):  # summed in float64 like the python floats
                            value = value.to(device, torch.float64)
                        metric_sums[key] = metric_sums.get(key, 0.0) + value
                    if output.loss.requires_grad:
                        (output.loss * weight).backward()
            engine.set_gradient_sync(True)
            engine.check_gradient_isolation(role)
            params = engine.params[role]

            divisor = 1.0
            if tracker.mode == "count":
                count = self._all_reduce(
                    torch.tensor([tracker.local_count], dtype=torch.float64, device=device)
                )
                divisor = tracker.gradient_divisor(count.item() / self.world_size)
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.grad.div_(divisor)

            with record_function("verl_dmd.grad_norm"):
                norm = _total_grad_norm(params, device, self.group)
                # One collective tells every rank which ranks saw a non-finite loss (a non-finite term makes
                # the sum non-finite); the norm is global already. Both are read back in one wait.
                flags = torch.zeros(self.world_size, dtype=torch.float64, device=device)
                flags[self.rank] = (~torch.isfinite(loss_sum)).to(torch.float64)
                *flag_values, grad_norm = torch.cat([self._all_reduce(flags), norm.reshape(1)]).tolist()
                bad_ranks = [r for r, flag in enumerate(flag_values) if flag > 0]
                skipped_reason = None
                if bad_ranks:
                    skipped_reason = f"non-finite loss on rank(s) {bad_ranks}"
                elif not math.isfinite(grad_norm):
                    skipped_reason = f"non-finite gradient norm ({grad_norm})"

            with record_function("verl_dmd.step"):
                if skipped_reason is None:
                    if optim_spec.grad_clip > 0 and grad_norm > optim_spec.grad_clip:
                        scale = optim_spec.grad_clip / (grad_norm + 1e-6)
                        with torch.no_grad():
                            for p in params:
                                if p.grad is not None:
                                    p.grad.mul_(scale)
                    engine.optimizer_step(role)
                    engine.schedulers[role].step()
                engine.zero_grad(role)
        with record_function("verl_dmd.ema"):
            if skipped_reason is None and role is Role.STUDENT:
                engine.update_ema(request.global_step + 1)

        with record_function("verl_dmd.metrics"):
            # Metrics are averaged by position, so every rank must report the same keys in the same
            # order. A fixed-size reduce of (key count, CRC of the keys) checks that first: reducing
            # tensors of different lengths would hang. Every rank sees the same sums and raises alike.
            # One rank cannot disagree with itself: no check, and one wait for the device less.
            key_crc = float(zlib.crc32("\n".join(metric_sums).encode()))
            if self.world_size > 1 and self._all_reduce(
                torch.tensor([len(metric_sums), key_crc], dtype=torch.float64, device=device)
            ).tolist() != [len(metric_sums) * self.world_size, key_crc * self.world_size]:
                raise RuntimeError(
                    f"ranks reported different metric keys in a {role.value} phase (rank {self.rank}: "
                    f"{sorted(metric_sums)}); a phase computer must return the same metrics on every rank"
                )
            values = [loss_sum / len(micro_batches), *metric_sums.values()]
            stacked = torch.stack([
                v.to(device, torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                else torch.full((), float(v), dtype=torch.float64, device=device)  # a fill, not a host copy
                for v in values
            ])  # fmt: skip
            mean = (self._all_reduce(stacked) / self.world_size).tolist()
            metrics = {
                f"{role.value}/{k}": v / len(micro_batches)
                for k, v in zip(metric_sums, mean[1:], strict=True)
            }
            metrics.update(
                {
                    f"{role.value}/loss": mean[0],
                    f"{role.value}/grad_norm": grad_norm,
                    f"{role.value}/lr": engine.optimizers[role].param_groups[0]["lr"],
                    "stepped": skipped_reason is None,
                    "skipped_reason": skipped_reason,
                    "phase_seconds": time.perf_counter() - started,
                }
            )
        return metrics
