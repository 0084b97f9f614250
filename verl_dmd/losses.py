"""The DMD2 math as pure tensor functions: noising, x0 conversions, CFG, the DMD gradient and the losses.

Layer 1: this module imports only torch and the standard library; it knows
nothing of roles, ranks or models, so every function is testable in
milliseconds against a float64 re-derivation.

Conventions (flow matching, see docs/): a noise level ``sigma`` lies in [0, 1],
``x_t = (1 - sigma) * x0 + sigma * eps``, the model predicts the velocity
``v = eps - x0`` and ``x0_hat = x_t - sigma * v_hat``. Wherever an argument is
called ``sigma`` (or ``alpha``) it may be a python float, a 0-dim tensor, or a
1-D tensor of shape ``(batch,)`` that is broadcast over the non-batch dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "CFG_FORMS",
    "DMD_NORMALIZERS",
    "EDM_SIGMA_DATA",
    "FAKE_SCORE_WEIGHTINGS",
    "PARAMETERIZATIONS",
    "DMDGradient",
    "add_noise",
    "classifier_free_guidance",
    "dmd_gradient",
    "fake_score_loss",
    "fake_score_weight",
    "gan_discriminator_loss",
    "gan_generator_loss",
    "ode_step",
    "prediction_target",
    "regression_loss",
    "sample_sigmas",
    "shift_sigma",
    "standard_guidance_scale",
    "student_sigma_schedule",
    "velocity_target",
    "x0_from_epsilon",
    "x0_from_prediction",
    "x0_from_velocity",
]

CFG_FORMS: tuple[str, ...] = ("standard", "conditional_offset")
"""Classifier-free guidance forms: ``standard`` is the DMD2 default, the other a named option."""

DMD_NORMALIZERS: tuple[str, ...] = ("per_sample", "batch_global")
"""Scopes of the mean |x - x0_real| that divides the DMD gradient; ``per_sample`` is the default."""

PARAMETERIZATIONS: tuple[str, ...] = ("velocity", "epsilon", "x0")
"""What a model predicts at ``x_t``: the velocity ``eps - x0`` (the flow families), the noise, or x0."""

FAKE_SCORE_WEIGHTINGS: tuple[str, ...] = ("uniform", "dmd2_sd", "edm")
"""Weightings of the fake-score denoising loss (`fake_score_weight`); ``uniform`` is the default."""

EDM_SIGMA_DATA = 0.5
"""The data standard deviation in the ``edm`` weighting (EDM's and DMD2's ImageNet value)."""

SigmaLike = float | torch.Tensor


# ----------------------------------------------------------------------------- helpers


def _broadcast_per_sample(
    value: SigmaLike, *, like: torch.Tensor, dtype: torch.dtype, name: str
) -> SigmaLike:
    """Return `value` ready to multiply a tensor shaped like `like`.

    A python number stays a python float (so it never changes the tensor's dtype);
    a 0-dim tensor is cast to `dtype`; a 1-D tensor of shape (batch,) is cast and
    viewed as (batch, 1, ..., 1). Anything else is a shape bug and fails here
    instead of broadcasting silently along the wrong axis.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return value.to(device=like.device, dtype=dtype)
        if value.ndim == 1 and like.ndim >= 1 and value.shape[0] == like.shape[0]:
            view = (value.shape[0],) + (1,) * (like.ndim - 1)
            return value.to(device=like.device, dtype=dtype).reshape(view)
        batch = like.shape[0] if like.ndim >= 1 else "none"
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}: must be a python float, a 0-dim tensor or a 1-D tensor "
            f"of shape (batch,) = ({batch},) for a tensor of shape {tuple(like.shape)}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} is a {type(value).__name__}: must be a python float or a torch.Tensor")
    return float(value)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise if the named tensors differ in shape: broadcasting here would hide a bug."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; these arguments must have identical shapes")


def _at_least_float32(*tensors: torch.Tensor) -> torch.dtype:
    """The promoted floating dtype of `tensors`, never narrower than float32."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_finite_positive(name: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} = {value!r}: must be a finite number > 0")
    return float(value)


# ----------------------------------------------------------------------------- noise levels


def shift_sigma(sigma: SigmaLike, shift: float) -> SigmaLike:
    """Apply the timestep shift ``s*sigma / (1 + (s-1)*sigma)`` (SD3 uses s=3).

    The shift maps [0, 1] onto itself monotonically, fixing 0 and 1; s > 1 moves
    mass towards high noise, which high-resolution flow models need. ``shift == 1``
    returns `sigma` itself, untouched, so the default costs no rounding.
    """
    shift = _check_finite_positive("shift", shift)
    if shift == 1.0:
        return sigma
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def sample_sigmas(
    batch_size: int,
    *,
    generator: torch.Generator,
    sigma_min: float,
    sigma_max: float,
    shift: float = 1.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw one noise level per sample, uniform in [sigma_min, sigma_max], then shifted.

    Randomness comes only from `generator` (drawn on its device in float64), so a
    seeded generator reproduces the draw exactly; the result is then moved to
    `device` (default: the generator's) and cast to `dtype`. Returns shape (batch_size,).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an integer >= 1")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator is a {type(generator).__name__}: must be a torch.Generator (seeded by the caller)"
        )
    for name, value in (("sigma_min", sigma_min), ("sigma_max", sigma_max)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} = {value!r}: must be a number in [0, 1]")
    if sigma_min > sigma_max:
        raise ValueError(
            f"sigma_min = {sigma_min!r} > sigma_max = {sigma_max!r}: must satisfy 0 <= sigma_min <= sigma_max <= 1"
        )
    shift = _check_finite_positive("shift", shift)
    uniform = torch.rand(batch_size, generator=generator, device=generator.device, dtype=torch.float64)
    sigma = sigma_min + (sigma_max - sigma_min) * uniform
    sigma = shift_sigma(sigma, shift)
    return sigma.to(device=generator.device if device is None else device, dtype=dtype)


def student_sigma_schedule(
    num_steps: int,
    *,
    shift: float = 1.0,
    sigma_max: float = 1.0,
    sigmas: list[float] | tuple[float, ...] | None = None,
) -> torch.Tensor:
    """The student's sampling noise levels: float32, length num_steps + 1, strictly decreasing, ending in 0.0.

    Default: ``linspace(sigma_max, 0, num_steps + 1)`` shifted by `shift`; 4 steps
    unshifted give [1, .75, .5, .25, 0], DMD2's SDXL timesteps {999, 749, 499, 249}/1000
    up to the discrete-timestep offset. Explicit `sigmas` (num_steps values in (0, 1],
    strictly decreasing) are used verbatim with 0.0 appended; `shift` and
    `sigma_max` do not apply to them.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps = {num_steps!r}: must be an integer >= 1")
    shift = _check_finite_positive("shift", shift)
    if sigmas is None:
        if (
            isinstance(sigma_max, bool)
            or not isinstance(sigma_max, int | float)
            or not 0.0 < sigma_max <= 1.0
        ):
            raise ValueError(f"sigma_max = {sigma_max!r}: must be a number in (0, 1]")
        levels = shift_sigma(torch.linspace(float(sigma_max), 0.0, num_steps + 1, dtype=torch.float64), shift)
        schedule = levels.to(torch.float32)
        schedule[-1] = 0.0
    else:
        values = list(sigmas)
        if len(values) != num_steps:
            raise ValueError(f"sigmas has {len(values)} values: must have exactly num_steps = {num_steps}")
        previous = math.inf
        for position, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
                raise ValueError(f"sigmas[{position}] = {value!r}: must be a number in (0, 1]")
            if value >= previous:
                raise ValueError(
                    f"sigmas[{position}] = {value!r} is not below sigmas[{position - 1}] = {previous!r}: "
                    "sigmas must be strictly decreasing"
                )
            previous = value
        schedule = torch.tensor([*values, 0.0], dtype=torch.float32)
    # float32 can merge levels closer than its resolution; a repeated level is a no-op step.
    steps = schedule[:-1] - schedule[1:]
    if not bool((steps > 0).all()):
        position = int(torch.nonzero(steps <= 0)[0].item()) + 1
        raise ValueError(
            f"sigma schedule entry {position} = {schedule[position].item()!r} does not decrease in float32: "
            "use fewer num_steps or levels further apart"
        )
    return schedule


def add_noise(x0: torch.Tensor, eps: torch.Tensor, sigma: SigmaLike) -> torch.Tensor:
    """Noise clean samples to level sigma: ``x_t = (1 - sigma) * x0 + sigma * eps``."""
    _check_same_shape(x0=x0, eps=eps)
    sigma = _broadcast_per_sample(
        sigma, like=x0, dtype=torch.promote_types(x0.dtype, eps.dtype), name="sigma"
    )
    return (1.0 - sigma) * x0 + sigma * eps


def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The flow-matching regression target ``v = eps - x0`` (independent of sigma)."""
    _check_same_shape(x0=x0, eps=eps)
    return eps - x0


def x0_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigma: SigmaLike) -> torch.Tensor:
    """Recover the clean-sample estimate from a velocity prediction: ``x0_hat = x_t - sigma * v_hat``."""
    _check_same_shape(x_t=x_t, velocity=velocity)
    dtype = torch.promote_types(x_t.dtype, velocity.dtype)
    sigma = _broadcast_per_sample(sigma, like=x_t, dtype=dtype, name="sigma")
    return x_t - sigma * velocity


def x0_from_epsilon(
    x_t: torch.Tensor, eps_hat: torch.Tensor, alpha: SigmaLike, sigma: SigmaLike
) -> torch.Tensor:
    """Recover x0_hat from a noise prediction under ``x_t = alpha * x0 + sigma * eps``.

    Covers the UNet/EDM families (e.g. alpha = sqrt(alphā), sigma = sqrt(1 - alphā));
    for flow matching alpha = 1 - sigma and the result equals `x0_from_velocity`.
    alpha = 0 is pure noise and has no x0 estimate: a python 0.0 raises, a tensor
    zero yields inf/NaN (not checked, to avoid a device sync).
    """
    _check_same_shape(x_t=x_t, eps_hat=eps_hat)
    if not isinstance(alpha, torch.Tensor) and alpha == 0:
        raise ValueError("alpha = 0: must be nonzero; x_t at alpha = 0 is pure noise and has no x0 estimate")
    dtype = torch.promote_types(x_t.dtype, eps_hat.dtype)
    alpha = _broadcast_per_sample(alpha, like=x_t, dtype=dtype, name="alpha")
    sigma = _broadcast_per_sample(sigma, like=x_t, dtype=dtype, name="sigma")
    return (x_t - sigma * eps_hat) / alpha


def _check_parameterization(parameterization: str) -> None:
    if parameterization not in PARAMETERIZATIONS:
        raise ValueError(f"parameterization = {parameterization!r}: must be one of {PARAMETERIZATIONS}")


def x0_from_prediction(
    parameterization: str, x_t: torch.Tensor, prediction: torch.Tensor, sigma: SigmaLike
) -> torch.Tensor:
    """The x0 estimate of a model of `parameterization` (velocity, epsilon or x0) at level sigma.

    Epsilon prediction has no estimate at sigma = 1 (``x_t`` is pure noise there; a python 1.0
    raises, a tensor one yields inf/NaN), which is why an epsilon family samples from below 1.
    """
    _check_parameterization(parameterization)
    if parameterization == "velocity":
        return x0_from_velocity(x_t, prediction, sigma)
    if parameterization == "epsilon":
        return x0_from_epsilon(x_t, prediction, 1.0 - sigma, sigma)
    _check_same_shape(x_t=x_t, prediction=prediction)
    return prediction


def prediction_target(parameterization: str, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """What a model of `parameterization` should predict for ``add_noise(x0, eps, sigma)``, in at least
    float32: the velocity ``eps - x0``, the noise, or x0 (none depends on sigma)."""
    _check_parameterization(parameterization)
    _check_same_shape(x0=x0, eps=eps)
    dtype = _at_least_float32(x0, eps)
    if parameterization == "velocity":
        return velocity_target(x0.to(dtype), eps.to(dtype))
    return (eps if parameterization == "epsilon" else x0).to(dtype)


def ode_step(
    parameterization: str,
    x_t: torch.Tensor,
    prediction: torch.Tensor,
    sigma: SigmaLike,
    next_sigma: SigmaLike,
) -> torch.Tensor:
    """One deterministic step of the probability-flow ODE from `sigma` to `next_sigma`.

    Velocity: the Euler step ``x_t + (next_sigma - sigma) * v``. Otherwise the same step through the x0
    and noise estimates, ``(1 - next_sigma) * x0 + next_sigma * eps`` (DDIM), which for a velocity model
    is the Euler step exactly; `sigma` must then lie in (0, 1) for epsilon and (0, 1] for x0 prediction.
    """
    _check_parameterization(parameterization)
    if parameterization == "velocity":
        step = next_sigma - sigma
        return x_t + (step.to(x_t.dtype) if isinstance(step, torch.Tensor) else step) * prediction
    x0 = x0_from_prediction(parameterization, x_t, prediction, sigma)
    dtype = torch.promote_types(x_t.dtype, prediction.dtype)
    level = _broadcast_per_sample(sigma, like=x_t, dtype=dtype, name="sigma")
    following = _broadcast_per_sample(next_sigma, like=x_t, dtype=dtype, name="next_sigma")
    eps = prediction if parameterization == "epsilon" else (x_t - (1.0 - level) * x0) / level
    return (1.0 - following) * x0 + following * eps


# ----------------------------------------------------------------------------- guidance


def standard_guidance_scale(scale: float, form: str = "standard") -> float:
    """A CFG scale of `form` as the equivalent scale of the standard form (1 means no guidance)."""
    if form not in CFG_FORMS:
        raise ValueError(f"form = {form!r}: must be one of {CFG_FORMS}")
    return float(scale) + (1.0 if form == "conditional_offset" else 0.0)


def classifier_free_guidance(
    uncond: torch.Tensor, cond: torch.Tensor, scale: float, form: str = "standard"
) -> torch.Tensor:
    """Combine unconditional and conditional predictions with guidance `scale`.

    ``standard``: ``uncond + scale * (cond - uncond)``, the DMD2 convention; scale 1
    means no guidance and returns `cond` itself with no arithmetic. ``conditional_offset``:
    ``cond + scale * (cond - uncond)``, the same as standard at ``scale + 1``; offered
    only so recipes that use it can say so (scale 0 returns `cond` itself). Works in
    the inputs' dtype; upcast first if that matters.
    """
    if form not in CFG_FORMS:
        raise ValueError(f"form = {form!r}: must be one of {CFG_FORMS}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale = {scale!r}: must be a finite number")
    _check_same_shape(uncond=uncond, cond=cond)
    if form == "standard":
        if scale == 1:
            return cond
        return uncond + scale * (cond - uncond)
    if scale == 0:
        return cond
    return cond + scale * (cond - uncond)


# ----------------------------------------------------------------------------- the DMD gradient


@dataclass(frozen=True)
class DMDGradient:
    """The distribution-matching gradient of one micro-batch, with what was used to build it."""

    grad: torch.Tensor
    """Same shape as x; float32, or float64 when an input was float64. Never requires grad."""
    normalizer: torch.Tensor
    """Shape (batch,): the denominator each sample was divided by, after the eps floor
    (for ``batch_global`` one value repeated)."""
    nonfinite: torch.Tensor
    """0-dim int64 on grad's device: the number of NaN/inf entries in `grad`; they are kept, not zeroed,
    so the phase can be skipped. A tensor, so that building the gradient never waits for the device."""

    @property
    def nonfinite_count(self) -> int:
        """`nonfinite` as a python int (reads it back from the device)."""
        return int(self.nonfinite.item())

    @property
    def is_finite(self) -> bool:
        """True when every entry of `grad` is finite."""
        return self.nonfinite_count == 0


def dmd_gradient(
    x: torch.Tensor,
    x0_fake: torch.Tensor,
    x0_real: torch.Tensor,
    *,
    normalizer: str = "per_sample",
    eps: float = 1e-6,
) -> DMDGradient:
    """The DMD2 gradient ``(x0_fake - x0_real) / max(mean|x - x0_real|, eps)``.

    The mean runs over every non-batch dim of each sample (``per_sample``, the
    DMD2 default) or over the whole micro-batch (``batch_global``); dividing by it
    makes the step size invariant to how far the teacher's estimate is from x.
    Math runs under no_grad in float32, or float64 if any input is float64
    (inputs are upcast, never downcast). Non-finite values are propagated, not
    zeroed: a sample whose denominator is non-finite (e.g. inf in x) gets an
    all-NaN gradient, because dividing by inf would turn it into a silent zero.
    """
    if normalizer not in DMD_NORMALIZERS:
        raise ValueError(f"normalizer = {normalizer!r}: must be one of {DMD_NORMALIZERS}")
    eps = _check_finite_positive("eps", eps)
    _check_same_shape(x=x, x0_fake=x0_fake, x0_real=x0_real)
    if x.ndim < 1 or x.numel() == 0:
        raise ValueError(
            f"x has shape {tuple(x.shape)}: must have a leading batch dim and at least one element"
        )
    for name, t in (("x", x), ("x0_fake", x0_fake), ("x0_real", x0_real)):
        if not t.is_floating_point():
            raise ValueError(f"{name} has dtype {t.dtype}: must be a floating-point tensor")
    wide = torch.float64 if torch.float64 in (x.dtype, x0_fake.dtype, x0_real.dtype) else torch.float32
    batch = x.shape[0]
    with torch.no_grad():
        x_w, fake_w, real_w = (t.detach().to(wide) for t in (x, x0_fake, x0_real))
        distance = (x_w - real_w).abs().reshape(batch, -1)
        if normalizer == "per_sample":
            mean_distance = distance.mean(dim=1)
        else:
            mean_distance = distance.mean().expand(batch).contiguous()
        # clamp_min keeps NaN as NaN, so a NaN denominator is reported, not floored.
        denominator = mean_distance.clamp_min(eps)
        per_sample = denominator.reshape((batch,) + (1,) * (x.ndim - 1))
        grad = (fake_w - real_w) / per_sample
        grad = torch.where(torch.isfinite(per_sample), grad, torch.nan)
        nonfinite = (~torch.isfinite(grad)).sum()
    return DMDGradient(grad=grad, normalizer=denominator, nonfinite=nonfinite)


# ----------------------------------------------------------------------------- losses


def generator_surrogate_loss(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The student loss ``0.5 * mean((x - stopgrad(x - grad))**2)`` whose gradient in x is ``grad / x.numel()``.

    A surrogate: its value is 0.5 * mean(grad**2), which says nothing about sample
    quality; only its gradient matters. Computed in x's dtype upcast to at least
    float32. Returns a 0-dim tensor that carries the graph of x.
    """
    _check_same_shape(x=x, grad=grad)
    dtype = _at_least_float32(x)
    x_w = x.to(dtype)
    target = (x_w - grad.to(device=x.device, dtype=dtype)).detach()
    return 0.5 * (x_w - target).square().mean()


def fake_score_weight(weighting: str, parameterization: str, sigma: torch.Tensor) -> torch.Tensor | None:
    """Per-sample weights of the fake score's squared prediction error that make the loss `weighting`.

    With ``e`` the error of the model's own prediction (`prediction_target`) at level sigma:
    ``uniform`` is ``mean(e^2)`` (no weights: None); ``dmd2_sd`` is the MSE of the predicted noise, as
    DMD2's SD/SDXL code trains its fake score (the noise error is ``c * e`` with c = 1 - sigma for
    velocity, 1 for epsilon, (1 - sigma)/sigma for x0 prediction, so the weight is c^2); ``edm`` is
    DMD2's ImageNet (EDM) loss ``(1/sigma_ve^2 + 1/sigma_data^2) * |x0_hat - x0|^2`` with the flow
    level's VE noise ``sigma_ve = sigma/(1 - sigma)`` and sigma_data = `EDM_SIGMA_DATA` (the x0 error is
    ``d * e`` with d = sigma, sigma/(1 - sigma), 1; weight c^2 + d^2/sigma_data^2). Returns shape (batch,)
    in sigma's dtype (float64 for float64 sigma).
    """
    if weighting not in FAKE_SCORE_WEIGHTINGS:
        raise ValueError(f"weighting = {weighting!r}: must be one of {FAKE_SCORE_WEIGHTINGS}")
    _check_parameterization(parameterization)
    if weighting == "uniform":
        return None
    if not isinstance(sigma, torch.Tensor) or sigma.ndim != 1:
        raise ValueError("sigma must be a 1-D tensor of per-sample noise levels for a weighted loss")
    s = sigma if sigma.is_floating_point() else sigma.float()
    noise_scale = {"velocity": 1.0 - s, "epsilon": torch.ones_like(s), "x0": (1.0 - s) / s}[parameterization]
    weight = noise_scale.square()
    if weighting == "edm":
        x0_scale = {"velocity": s, "epsilon": s / (1.0 - s), "x0": torch.ones_like(s)}[parameterization]
        weight = weight + x0_scale.square() / EDM_SIGMA_DATA**2
    return weight


def fake_score_loss(
    prediction: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """MSE of the fake score's prediction against its `target` (`prediction_target`), upcast to >= float32.

    `weight` of shape (batch,) scales each sample's mean squared error before the
    batch mean (`fake_score_weight`). The target is not detached here: build it
    from a detached student sample, as the critic phase does.
    """
    _check_same_shape(prediction=prediction, target=target)
    dtype = _at_least_float32(prediction, target)
    error = (prediction.to(dtype) - target.to(dtype)).square()
    if weight is None:
        return error.mean()
    batch = prediction.shape[0] if prediction.ndim >= 1 else None
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or weight.shape[0] != batch:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"weight has shape {shape}: must be None or a 1-D tensor of shape (batch,) = ({batch},)"
        )
    per_sample = error.reshape(batch, -1).mean(dim=1)
    return (weight.to(device=per_sample.device, dtype=dtype) * per_sample).mean()


def gan_generator_loss(logits_fake: torch.Tensor) -> torch.Tensor:
    """Non-saturating GAN generator loss ``mean(softplus(-D(fake)))``, upcast to >= float32."""
    logits = logits_fake.to(_at_least_float32(logits_fake))
    return F.softplus(-logits).mean()


def gan_discriminator_loss(logits_fake: torch.Tensor, logits_real: torch.Tensor) -> torch.Tensor:
    """GAN discriminator loss ``mean(softplus(D(fake))) + mean(softplus(-D(real)))``, upcast to >= float32.

    The two means are separate so fake and real batches may differ in size.
    """
    fake = logits_fake.to(_at_least_float32(logits_fake))
    real = logits_real.to(_at_least_float32(logits_real))
    return F.softplus(fake).mean() + F.softplus(-real).mean()


def regression_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """DMD v1's paired regression term as a plain MSE, upcast to >= float32.

    DMD v1 used LPIPS on (noise, teacher image) pairs; a perceptual network is out
    of scope for this module, so callers wanting LPIPS compute it elsewhere.
    """
    _check_same_shape(pred=pred, target=target)
    dtype = _at_least_float32(pred, target)
    return (pred.to(dtype) - target.to(dtype)).square().mean()
