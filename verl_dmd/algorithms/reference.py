"""A tiny reference phase computer: per-role regression, used to test the runtime without DMD2.

Each phase regresses the active role's prediction onto `batch["target"]`. In
student phases the teacher and the fake score also run (under no_grad) between
the student's forward and its backward, and shift the target; that is exactly
the pattern DMD2 has, so the runtime's role switching is exercised for real.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_dmd import seeding
from verl_dmd.batch import prefixed
from verl_dmd.phases import PhaseOutput, PhaseRequest, PhaseRuntime, Role

COND_PREFIX = "cond."


def regression_batch(adapter, model: torch.nn.Module, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic batch for `ReferenceRegressionComputer`: x_t, sigma, target and cond.* tensors."""
    generator = seeding.generator(seed, "reference.batch")
    x0, cond = adapter.example_batch(model, batch_size, generator)
    sigma = torch.rand(batch_size, generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    batch = {
        "x_t": (1 - sigma.view(-1, *[1] * (x0.dim() - 1))) * x0
        + sigma.view(-1, *[1] * (x0.dim() - 1)) * noise
    }
    batch["sigma"] = sigma
    batch["target"] = noise - x0
    batch.update({COND_PREFIX + k: v for k, v in cond.items()})
    return batch


class ReferenceRegressionComputer:
    """Mean-squared error of the role's prediction; optional count-mode normalizer."""

    def __init__(
        self,
        adapter,
        *,
        frozen_mix: float = 0.1,
        normalizer: str = "mean",
        leak_frozen: bool = False,
        nan_on_rank: int | None = None,
    ) -> None:
        if normalizer not in ("mean", "count", "mixed"):
            raise ValueError(f"normalizer = {normalizer!r}: allowed: mean, count, mixed")
        self.adapter = adapter
        self.frozen_mix = frozen_mix
        # Test hooks, each a deliberate contract violation the runtime must catch:
        # "mixed" alternates normalizer modes within a phase; leak_frozen unfreezes the
        # frozen base weights before the forward; nan_on_rank poisons one rank's loss.
        self.normalizer = normalizer
        self.leak_frozen = leak_frozen
        self.nan_on_rank = nan_on_rank
        self.calls = 0

    def _predict(self, module, batch: Mapping[str, Any]) -> torch.Tensor:
        return self.adapter.predict(module, batch["x_t"], batch["sigma"], prefixed(batch, COND_PREFIX))

    def compute_phase(
        self, request: PhaseRequest, batch, runtime: PhaseRuntime, *, micro_batch_index, num_micro_batches
    ):
        self.calls += 1
        if self.leak_frozen:  # unfreeze every frozen weight of every role's model (the base, other roles)
            models = {
                id(m): m for m in map(runtime.module_for, (Role.TEACHER, Role.STUDENT, Role.FAKE_SCORE))
            }
            for model in models.values():
                for p in model.parameters():
                    if not p.requires_grad:
                        p.requires_grad_(True)
        prediction = self._predict(runtime.module_for(request.role), batch)
        target = batch["target"]
        if request.role is Role.STUDENT and self.frozen_mix:
            with torch.no_grad():
                with runtime.use_role(Role.TEACHER) as teacher:
                    teacher_prediction = self._predict(teacher, batch)
                with runtime.use_role(Role.FAKE_SCORE) as fake:
                    fake_prediction = self._predict(fake, batch)
            target = target + self.frozen_mix * (teacher_prediction - fake_prediction)
        dtype = torch.promote_types(prediction.dtype, torch.float32)  # float64 runs stay float64
        loss = (prediction.to(dtype) - target.to(dtype)).square().mean()
        if self.nan_on_rank is not None and runtime.rank == self.nan_on_rank:
            loss = loss * float("nan")
        count = float(target.numel())
        if self.normalizer == "mean" or (self.normalizer == "mixed" and micro_batch_index % 2):
            count = None
        return PhaseOutput(loss=loss, metrics={"mse": loss.detach()}, loss_normalizer=count)

    def extra_modules(self) -> tuple:
        return ()

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.calls = int(state["calls"])

    def reseed(self, salt: int) -> None:
        """No random streams: nothing to re-seed."""
