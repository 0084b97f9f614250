"""Sampling any role at any number of steps, and writing samples as .npz and a PNG grid.

Two samplers, both in the flow-matching convention of docs/dmd2.md
(``x_t = (1 - sigma) x0 + sigma eps``, the model predicts ``eps - x0``):

- `euler_sample`: the teacher's probability-flow ODE, Euler steps from sigma = 1 to 0,
  with optional classifier-free guidance;
- `few_step_sample`: a distilled student's sampler: predict x0 at each level of its
  schedule, re-noise to the next level with fresh noise, return the last x0.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_dmd import losses


def _levels(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigma.to(like.device, like.dtype).expand(like.shape[0])


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
    """Euler integration of the velocity field from `noise` (sigma = 1) to sigma = 0."""
    if steps < 1:
        raise ValueError(f"steps = {steps!r}: must be a positive integer")
    if guidance != 1.0 and uncond is None:
        raise ValueError(f"guidance = {guidance}: classifier-free guidance needs the unconditional inputs")
    sigmas = losses.shift_sigma(torch.linspace(1.0, 0.0, steps + 1), shift)
    x = noise
    for sigma, next_sigma in itertools.pairwise(sigmas):
        level = _levels(sigma, x)
        velocity = adapter.predict(module, x, level, cond)
        if guidance != 1.0:
            velocity = losses.classifier_free_guidance(
                adapter.predict(module, x, level, uncond), velocity, guidance
            )
        x = x + (next_sigma - sigma).to(x.dtype) * velocity
    return x


@torch.no_grad()
def few_step_sample(
    adapter,
    module,
    noise: torch.Tensor,
    cond: Mapping[str, Any],
    schedule: torch.Tensor | Sequence[float],
    generator: torch.Generator | Sequence[torch.Tensor],
) -> torch.Tensor:
    """A few-step student's sample: x0 at each noise level of `schedule` (ending in 0), re-noised between.

    `generator` draws the fresh noise of each re-noising (float32, the batch's shape), or is the
    list of those tensors drawn beforehand (one per intermediate level: `renoise_draws`), which
    lets ranks sample parts of one batch exactly as one process samples all of it.
    """
    schedule = torch.as_tensor(schedule, dtype=torch.float32)
    if schedule.ndim != 1 or schedule.numel() < 2 or float(schedule[-1]) != 0.0:
        raise ValueError(f"schedule = {schedule.tolist()}: must be 1-d, at least 2 levels, ending in 0")
    drawn = None if isinstance(generator, torch.Generator) else list(generator)
    if drawn is not None and len(drawn) != schedule.numel() - 2:
        raise ValueError(f"{len(drawn)} re-noising tensors for a {schedule.numel() - 1}-step schedule")
    x_t = noise
    x0 = noise
    for index, (sigma, next_sigma) in enumerate(itertools.pairwise(schedule)):
        level = _levels(sigma, x_t)
        x0 = losses.x0_from_velocity(x_t, adapter.predict(module, x_t, level, cond), level)
        if float(next_sigma) > 0.0:
            if drawn is None:
                fresh = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
            else:
                fresh = drawn[index]
            x_t = losses.add_noise(x0, fresh.to(x0.device, x0.dtype), _levels(next_sigma, x0))
    return x0


def renoise_draws(shape: Sequence[int], steps: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The fresh noise `few_step_sample` would draw from `generator` for a `steps`-step schedule."""
    return [torch.randn(tuple(shape), generator=generator, dtype=torch.float32) for _ in range(steps - 1)]


def even_schedule(steps: int, shift: float = 1.0) -> torch.Tensor:
    """Evenly spaced noise levels from 1 to 0 (steps + 1 of them), then shifted."""
    if steps < 1:
        raise ValueError(f"steps = {steps!r}: must be a positive integer")
    return losses.shift_sigma(torch.linspace(1.0, 0.0, steps + 1), shift)


def save_samples(path: str | Path, images: torch.Tensor, labels: torch.Tensor, **meta: Any) -> Path:
    """Write images (N, C, H, W) and labels (N,) to an .npz (no pickled objects), plus scalar metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {k: np.asarray(v) for k, v in meta.items()}
    for key, value in extra.items():
        if value.dtype == object:
            raise ValueError(f"metadata {key!r} = {meta[key]!r}: only numbers and strings can be stored")
    np.savez(path, images=images.detach().float().cpu().numpy(), labels=labels.cpu().numpy(), **extra)
    return path


def save_grid(
    path: str | Path, images: torch.Tensor, *, nrow: int, value_range: tuple[float, float] = (-1.0, 1.0)
) -> Path:
    """A PNG grid of images (N, C, H, W), C in {1, 3}, `nrow` images per row, 1-pixel gaps, upscaled 4x."""
    from PIL import Image

    images = images.detach().float().cpu()
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images of shape {tuple(images.shape)}: expected (N, 1 or 3, H, W)")
    low, high = value_range
    pixels = ((images - low) / (high - low)).clamp(0, 1).mul(255).round().to(torch.uint8)
    n, c, h, w = pixels.shape
    rows = -(-n // nrow)
    canvas = torch.full((c, rows * (h + 1) + 1, nrow * (w + 1) + 1), 64, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        canvas[:, 1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + col * (w + 1) : 1 + col * (w + 1) + w] = pixels[
            i
        ]
    array = canvas.permute(1, 2, 0).numpy()
    picture = Image.fromarray(array[..., 0] if c == 1 else array, mode="L" if c == 1 else "RGB")
    picture = picture.resize((picture.width * 4, picture.height * 4), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path)
    return path
