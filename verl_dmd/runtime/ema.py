"""The student's exponential moving average (the `student_ema` role) as a component of the role engine.

It owns the EMA's settings and its tensors. Where the tensors live is the storage
layout's choice: in the shared layout they are the ``student_ema`` LoRA adapter's
parameters on the base (a role like the others, saved with them under ``param/``);
in the independent layout the EMA keeps its own tensors, DTensor copies sharded
exactly like the student's parameters (saved under ``ema/``, resharded by DCP like
parameters), and `swap` exchanges them with the student's shards to sample as
``student_ema``. Either way `update` is ``ema.lerp_(student, 1 - decay)`` on the local
shards (the same sharding on both sides: no gather), or a copy before
``ema.start_step``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl_dmd.plan import EmaSpec
from verl_dmd.runtime.sharding import local_tensor


class StudentEma:
    """EMA of `student` parameters into `targets` (the adapter's parameters), or into tensors of its own."""

    def __init__(
        self,
        spec: EmaSpec,
        student: Sequence[torch.nn.Parameter],
        targets: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.spec = spec
        self.student = list(student)
        self.owns_tensors = targets is None
        # The shared layout's adapter starts as a copy of the student's (made before sharding); own tensors
        # start as clones of the student's shards.
        self.tensors: list[torch.Tensor] = (
            [p.detach().clone() for p in self.student] if targets is None else list(targets)
        )
        if len(self.tensors) != len(self.student):
            raise ValueError(f"EMA of {len(self.student)} student parameters got {len(self.tensors)} targets")

    @property
    def own_tensors(self) -> list[torch.Tensor]:
        """The tensors the EMA holds itself (state to save and move at sleep); none when they are a role's
        parameters."""
        return self.tensors if self.owns_tensors else []

    def weight(self, global_step: int) -> float:
        """The lerp weight after global step `global_step`: 1 (a copy) before ema.start_step, else 1 - decay."""
        return 1.0 if global_step < self.spec.start_step else 1.0 - self.spec.decay

    def update(self, global_step: int) -> None:
        """After a successful student step: EMA <- lerp(EMA, student, weight(global_step))."""
        weight = self.weight(global_step)
        with torch.no_grad():
            for target, student in zip(self.tensors, self.student, strict=True):
                local_tensor(target).lerp_(local_tensor(student), weight)

    def swap(self) -> None:
        """Exchange the student's shards with the EMA's own in place (the caller reshards first)."""
        if not self.owns_tensors:
            raise RuntimeError("swap() needs an EMA that holds its own tensors (the independent layout)")
        with torch.no_grad():
            for param, ema in zip(self.student, self.tensors, strict=True):
                shard, ema_shard = local_tensor(param), local_tensor(ema)
                scratch = shard.clone()
                shard.copy_(ema_shard)
                ema_shard.copy_(scratch)
