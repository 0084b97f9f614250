"""Sampling any role at any number of steps: the one few-step sampler and the teacher's ODE sampler.

Both work through the model adapter's parameterization (docs/dmd2.md: the flow
interpolation ``x_t = (1 - sigma) x0 + sigma eps``; the adapter converts its
prediction to x0 and steps the ODE), so they serve every family alike:

- `student_sample`: a distilled student's sampler: predict x0 at each level of its
  schedule, re-noise to the next level with fresh noise; stopped early at an exit
  step with grad there, it is DMD2's backward simulation (the computer's training
  sample), run to the end it is the evaluation's few-step sampler
  (`few_step_sample`);
- `euler_sample`: the teacher's probability-flow ODE from the adapter's highest
  level to 0, with optional classifier-free guidance.

Where noise comes from is the caller's: the computer draws it from its own
generators, the evaluation passes it pre-drawn (`renoise_draws`) so that ranks
sampling parts of a batch reproduce one process sampling all of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl_dmd import losses


def to_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor on `like`'s device and dtype, converted on the host (as a blocking copy converts).

    To a GPU it goes through pinned memory without waiting: a copy from pageable memory makes the
    host wait until the device has run everything queued before it, and the device then idles while
    the host prepares the next work.
    """
    tensor = tensor.to(like.dtype)
    if like.device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(like.device, non_blocking=True)
    return tensor.to(like.device)


def draw_normal(shape: Sequence[int], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise from a CPU generator (float32), on `like`'s device and dtype."""
    return to_like(torch.randn(tuple(shape), generator=generator, dtype=torch.float32), like)


def levels(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One noise level repeated per sample of `like`, on its device and dtype."""
    return to_like(sigma, like).expand(like.shape[0])


Renoise = Callable[[int, torch.Tensor], torch.Tensor]
"""`renoise(step, x0)`: the fresh noise that re-noises step `step`'s x0 estimate (x0's shape)."""


def student_sample(
    adapter,
    module,
    noise: torch.Tensor,
    cond: Mapping[str, Any],
    schedule: torch.Tensor,
    *,
    renoise: Renoise,
    last: int | None = None,
    grad: bool = False,
) -> torch.Tensor:
    """The student's x0 estimate at step `last` of `schedule` (default: its final step), from `noise`.

    `schedule` holds the levels (float32, ending in 0). Steps before `last` run without grad:
    predict x0, re-noise it with `renoise` to the next level; step `last` runs with grad if
    `grad` (backward simulation: the step DMD2 trains).
    """
    steps = schedule.numel() - 1
    last = steps - 1 if last is None else last
    if not 0 <= last < steps:
        raise ValueError(f"last = {last}: a {steps}-step schedule has steps 0 to {steps - 1}")
    x_t, x0 = noise, noise
    for step in range(last + 1):
        sigma = levels(schedule[step], noise)
        with torch.set_grad_enabled(grad and step == last):
            x0 = adapter.to_x0(x_t, adapter.predict(module, x_t, sigma, cond), sigma)
        if step < last:
            x_t = adapter.add_noise(x0.detach(), renoise(step, x0), levels(schedule[step + 1], noise))
    return x0


@torch.no_grad()
def few_step_sample(
    adapter,
    module,
    noise: torch.Tensor,
    cond: Mapping[str, Any],
    schedule: torch.Tensor | Sequence[float],
    generator: torch.Generator | Sequence[torch.Tensor],
) -> torch.Tensor:
    """A few-step student's sample: every level of `schedule` (ending in 0), re-noised in between.

    `generator` draws the fresh noise of each re-noising (float32, the batch's shape), or is the
    list of those tensors drawn beforehand (one per intermediate level: `renoise_draws`).
    """
    schedule = torch.as_tensor(schedule, dtype=torch.float32)
    if schedule.ndim != 1 or schedule.numel() < 2 or float(schedule[-1]) != 0.0:
        raise ValueError(f"schedule = {schedule.tolist()}: must be 1-d, at least 2 levels, ending in 0")
    if isinstance(generator, torch.Generator):

        def renoise(step: int, x0: torch.Tensor) -> torch.Tensor:
            return torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0.device, x0.dtype)

    else:
        drawn = list(generator)
        if len(drawn) != schedule.numel() - 2:
            raise ValueError(f"{len(drawn)} re-noising tensors for a {schedule.numel() - 1}-step schedule")

        def renoise(step: int, x0: torch.Tensor) -> torch.Tensor:
            return drawn[step].to(x0.device, x0.dtype)

    return student_sample(adapter, module, noise, cond, schedule, renoise=renoise)


@torch.no_grad()
def euler_sample(
    adapter,
    module,
    noise: torch.Tensor,
    cond: Mapping[str, Any],
    steps: int,
    *,
    guidance: float = 1.0,
    uncond: Mapping[str, Any] | None = None,
    shift: float = 1.0,
) -> torch.Tensor:
    """The probability-flow ODE from `noise` at the adapter's highest level to 0 in `steps` even steps
    (then shifted), with standard-form classifier-free guidance `guidance` (1: none)."""
    if steps < 1:
        raise ValueError(f"steps = {steps!r}: must be a positive integer")
    if guidance != 1.0 and uncond is None:
        raise ValueError(f"guidance = {guidance}: classifier-free guidance needs the unconditional inputs")
    x = noise
    for sigma, next_sigma in itertools.pairwise(even_schedule(steps, shift, adapter.sigma_max)):
        level = sigma.to(x.device, x.dtype).expand(x.shape[0])
        prediction = adapter.predict(module, x, level, cond)
        if guidance != 1.0:
            prediction = losses.classifier_free_guidance(
                adapter.predict(module, x, level, uncond), prediction, guidance
            )
        x = adapter.ode_step(x, prediction, sigma, next_sigma)
    return x


def trained_schedule(algorithm, sigma_max: float = 1.0) -> torch.Tensor:
    """The noise levels a few-step student is trained for (`algorithm.student_steps`, `sigma_shift`,
    `student_sigmas`), from the model adapter's `sigma_max`; float32, ending in 0."""
    return losses.student_sigma_schedule(
        algorithm.student_steps,
        shift=algorithm.sigma_shift,
        sigma_max=sigma_max,
        sigmas=algorithm.student_sigmas,
    )


def renoise_draws(shape: Sequence[int], steps: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The fresh noise `few_step_sample` would draw from `generator` for a `steps`-step schedule."""
    return [torch.randn(tuple(shape), generator=generator, dtype=torch.float32) for _ in range(steps - 1)]


def even_schedule(steps: int, shift: float = 1.0, sigma_max: float = 1.0) -> torch.Tensor:
    """Evenly spaced noise levels from `sigma_max` to 0 (steps + 1 of them, float32), then shifted."""
    if steps < 1:
        raise ValueError(f"steps = {steps!r}: must be a positive integer")
    return losses.shift_sigma(torch.linspace(sigma_max, 0.0, steps + 1), shift)
