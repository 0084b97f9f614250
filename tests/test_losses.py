"""verl_dmd.losses against independent float64 re-derivations (numpy, explicit per-sample loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_dmd import losses
from verl_dmd.losses import (
    CFG_FORMS,
    DMD_NORMALIZERS,
    DMDGradient,
    add_noise,
    classifier_free_guidance,
    dmd_gradient,
    fake_score_loss,
    gan_discriminator_loss,
    gan_generator_loss,
    generator_surrogate_loss,
    prediction_target,
    regression_loss,
    sample_sigmas,
    shift_sigma,
    student_sigma_schedule,
    velocity_target,
    x0_from_epsilon,
    x0_from_velocity,
)

REL_TOL = 1e-6
SHAPE = (3, 2, 4, 5)


def rel_err(actual, expected) -> float:
    """Norm-wise relative error max|a - e| / max|e| (absolute when the reference is all zero)."""
    a = np.asarray(
        actual.detach().cpu().numpy() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64
    )
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    scale = np.max(np.abs(e)) if e.size else 0.0
    diff = np.max(np.abs(a - e)) if e.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


def randn(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def ref_dmd_grad(x: np.ndarray, fake: np.ndarray, real: np.ndarray, normalizer: str, eps: float):
    """Float64 DMD gradient, one sample at a time with python-level sums."""
    batch = x.shape[0]
    per_sample_sum = []
    per_sample_count = []
    for b in range(batch):
        total = 0.0
        flat_x, flat_real = x[b].reshape(-1), real[b].reshape(-1)
        for i in range(flat_x.size):
            total += abs(float(flat_x[i]) - float(flat_real[i]))
        per_sample_sum.append(total)
        per_sample_count.append(flat_x.size)
    if normalizer == "per_sample":
        denoms = [max(s / n, eps) for s, n in zip(per_sample_sum, per_sample_count, strict=True)]
    else:
        denoms = [max(sum(per_sample_sum) / sum(per_sample_count), eps)] * batch
    grad = np.empty_like(x, dtype=np.float64)
    for b in range(batch):
        grad[b] = (fake[b].astype(np.float64) - real[b].astype(np.float64)) / denoms[b]
    return grad, np.array(denoms)


def np_softplus(z: np.ndarray) -> np.ndarray:
    """Stable softplus: max(z, 0) + log1p(exp(-|z|))."""
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


# ----------------------------------------------------------------------------- surrogate loss


def test_surrogate_loss_gradient_is_grad_over_numel():
    """d L_dm / d x equals grad / x.numel() and L_dm equals 0.5 * mean(grad^2) (float64)."""
    x = randn(*SHAPE, seed=0).requires_grad_(True)
    grad = randn(*SHAPE, seed=1)
    loss = generator_surrogate_loss(x, grad)
    assert loss.ndim == 0 and loss.requires_grad and loss.dtype == torch.float64
    loss.backward()
    g = grad.numpy()
    assert rel_err(x.grad, g / x.numel()) < REL_TOL
    assert rel_err(loss, np.mean(g * g) * 0.5) < REL_TOL


def test_surrogate_loss_upcasts_low_precision_and_keeps_graph():
    """A bf16 sample gives a float32 loss whose gradient flows back to the bf16 leaf."""
    x = randn(*SHAPE, seed=2, dtype=torch.bfloat16).requires_grad_(True)
    grad = randn(*SHAPE, seed=3, dtype=torch.float32)
    loss = generator_surrogate_loss(x, grad)
    assert loss.dtype == torch.float32
    loss.backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert not grad.requires_grad


# ----------------------------------------------------------------------------- DMD gradient


@pytest.mark.parametrize("normalizer", DMD_NORMALIZERS)
def test_dmd_gradient_matches_reference(normalizer):
    """Both normalizer scopes match the per-sample-loop float64 reference, grad and denominator."""
    x, fake, real = (randn(*SHAPE, seed=s) for s in (10, 11, 12))
    # Make the samples' distances differ so the two scopes genuinely disagree.
    x = real + (x - real) * torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64).reshape(3, 1, 1, 1)
    out = dmd_gradient(x, fake, real, normalizer=normalizer)
    ref_grad, ref_denoms = ref_dmd_grad(x.numpy(), fake.numpy(), real.numpy(), normalizer, 1e-6)
    assert isinstance(out, DMDGradient)
    assert out.grad.shape == x.shape and out.normalizer.shape == (3,)
    assert rel_err(out.grad, ref_grad) < REL_TOL
    assert rel_err(out.normalizer, ref_denoms) < REL_TOL
    assert out.nonfinite_count == 0 and out.is_finite


def test_dmd_normalizers_agree_exactly_when_per_sample_means_are_equal():
    """Equal per-sample mean |x - x0_real| gives identical grads under both scopes; unequal means differ."""
    gen = torch.Generator().manual_seed(4)
    # Dyadic values (k/8) and a constant |x - x0_real| of 0.5 keep every sum exact.
    real = torch.randint(-16, 16, SHAPE, generator=gen).double() / 8
    fake = torch.randint(-16, 16, SHAPE, generator=gen).double() / 8
    signs = torch.randint(0, 2, SHAPE, generator=gen).double() * 2 - 1
    x_equal = real + 0.5 * signs
    per_sample = dmd_gradient(x_equal, fake, real, normalizer="per_sample")
    batch_global = dmd_gradient(x_equal, fake, real, normalizer="batch_global")
    assert torch.equal(per_sample.grad, batch_global.grad)
    assert torch.equal(per_sample.normalizer, torch.full((3,), 0.5, dtype=torch.float64))

    x_unequal = real + signs * torch.tensor([0.25, 0.5, 2.0], dtype=torch.float64).reshape(3, 1, 1, 1)
    per_sample = dmd_gradient(x_unequal, fake, real, normalizer="per_sample")
    batch_global = dmd_gradient(x_unequal, fake, real, normalizer="batch_global")
    assert not torch.allclose(per_sample.grad, batch_global.grad)
    for name, out in (("per_sample", per_sample), ("batch_global", batch_global)):
        ref_grad, ref_denoms = ref_dmd_grad(x_unequal.numpy(), fake.numpy(), real.numpy(), name, 1e-6)
        assert rel_err(out.grad, ref_grad) < REL_TOL
        assert rel_err(out.normalizer, ref_denoms) < REL_TOL
    assert rel_err(batch_global.normalizer, [2.75 / 3] * 3) < REL_TOL


@pytest.mark.parametrize("normalizer", DMD_NORMALIZERS)
def test_dmd_gradient_eps_floor(normalizer):
    """x == x0_real makes the denominator exactly eps, so grad = (x0_fake - x0_real) / eps."""
    real, fake = randn(*SHAPE, seed=20), randn(*SHAPE, seed=21)
    out = dmd_gradient(real.clone(), fake, real, normalizer=normalizer, eps=1e-3)
    assert torch.equal(out.normalizer, torch.full((3,), 1e-3, dtype=torch.float64))
    assert rel_err(out.grad, (fake.numpy() - real.numpy()) / 1e-3) < REL_TOL


def test_dmd_gradient_keeps_and_counts_nan_in_x0_fake():
    """NaN in x0_fake stays in grad at the same places and is counted, not zeroed."""
    x, fake, real = (randn(*SHAPE, seed=s) for s in (30, 31, 32))
    fake[0, 1, 2, 3] = math.nan
    fake[2, 0, 0, 0] = math.nan
    out = dmd_gradient(x, fake, real)
    assert out.nonfinite_count == 2 and not out.is_finite
    assert torch.equal(torch.isnan(out.grad), torch.isnan(fake))
    ref_grad, _ = ref_dmd_grad(x.numpy(), fake.numpy(), real.numpy(), "per_sample", 1e-6)
    finite = np.isfinite(ref_grad)
    assert rel_err(out.grad.numpy()[finite], ref_grad[finite]) < REL_TOL


def test_dmd_gradient_keeps_and_counts_inf_in_x0_fake():
    """+inf in x0_fake yields +inf in grad at that entry, counted once."""
    x, fake, real = (randn(*SHAPE, seed=s) for s in (33, 34, 35))
    fake[1, 1, 1, 1] = math.inf
    out = dmd_gradient(x, fake, real)
    assert out.nonfinite_count == 1
    assert out.grad[1, 1, 1, 1].item() == math.inf


@pytest.mark.parametrize(("normalizer", "poisoned_samples"), [("per_sample", 1), ("batch_global", 3)])
def test_dmd_gradient_counts_inf_in_x_through_the_normalizer(normalizer, poisoned_samples):
    """inf in x makes the denominator inf; the affected samples' grads become NaN rather than silent zeros."""
    x, fake, real = (randn(*SHAPE, seed=s) for s in (36, 37, 38))
    x[1, 0, 0, 0] = math.inf
    out = dmd_gradient(x, fake, real, normalizer=normalizer)
    per_sample_numel = x[0].numel()
    assert out.nonfinite_count == poisoned_samples * per_sample_numel
    assert math.isinf(out.normalizer[1].item())
    if normalizer == "per_sample":
        assert torch.isnan(out.grad[1]).all()
        keep = [0, 2]
        ref_grad, _ = ref_dmd_grad(
            x.numpy()[keep], fake.numpy()[keep], real.numpy()[keep], "per_sample", 1e-6
        )
        assert rel_err(out.grad[keep], ref_grad) < REL_TOL
    else:
        assert torch.isnan(out.grad).all()


def test_dmd_gradient_nan_normalizer_is_not_floored():
    """A NaN in x0_real reaches the denominator as NaN (the eps floor must not hide it)."""
    x, fake, real = (randn(*SHAPE, seed=s) for s in (39, 40, 41))
    real[2, 0, 0, 0] = math.nan
    out = dmd_gradient(x, fake, real)
    assert math.isnan(out.normalizer[2].item())
    assert out.nonfinite_count == x[0].numel()


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_dmd_gradient_low_precision_inputs_give_float32(low):
    """bf16/fp16 inputs are upcast: grad and normalizer are float32 and match the float64 reference."""
    x, fake, real = (randn(*SHAPE, seed=s, dtype=low) for s in (50, 51, 52))
    out = dmd_gradient(x, fake, real)
    assert out.grad.dtype == torch.float32 and out.normalizer.dtype == torch.float32
    ref_grad, _ = ref_dmd_grad(*(t.double().numpy() for t in (x, fake, real)), "per_sample", 1e-6)
    assert rel_err(out.grad, ref_grad) < REL_TOL  # float32 math on exactly representable inputs


def test_dmd_gradient_float64_wins_and_never_downcasts():
    """Any float64 input makes the math float64; float32-only inputs stay float32."""
    x, fake = randn(*SHAPE, seed=53, dtype=torch.float32), randn(*SHAPE, seed=54, dtype=torch.bfloat16)
    real = randn(*SHAPE, seed=55)
    assert dmd_gradient(x, fake, real).grad.dtype == torch.float64
    assert dmd_gradient(x, fake, real.float()).grad.dtype == torch.float32


def test_dmd_gradient_never_requires_grad():
    """Inputs that require grad produce a detached gradient and normalizer."""
    x, fake, real = (randn(*SHAPE, seed=s).requires_grad_(True) for s in (56, 57, 58))
    out = dmd_gradient(x * 2, fake, real)
    assert not out.grad.requires_grad and not out.normalizer.requires_grad
    assert out.grad.grad_fn is None


def test_dmd_gradient_works_without_non_batch_dims():
    """A 1-D x is a batch of scalars: the per-sample mean is each |x - x0_real| itself."""
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    real = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    fake = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    out = dmd_gradient(x, fake, real)
    assert rel_err(out.normalizer, [0.5, 1e-6, 2.0]) < REL_TOL
    assert rel_err(out.grad, [0.5 / 0.5, -1.0 / 1e-6, 0.0 / 2.0]) < REL_TOL


def test_dmd_gradient_validates_arguments():
    """Shape mismatch, unknown normalizer, bad eps and 0-dim x raise one-line errors naming the argument."""
    x = torch.zeros(2, 3)
    cases = [
        (lambda: dmd_gradient(x, torch.zeros(2, 4), x), ["x0_fake", "(2, 4)", "(2, 3)"]),
        (lambda: dmd_gradient(x, x, x, normalizer="global"), ["normalizer", "'global'", "per_sample"]),
        (lambda: dmd_gradient(x, x, x, eps=0.0), ["eps", "0.0"]),
        (lambda: dmd_gradient(x, x, x, eps=math.inf), ["eps", "inf"]),
        (lambda: dmd_gradient(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0)), ["x", "()"]),
    ]
    for call, words in cases:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message
        for word in words:
            assert word in message, (word, message)


# ----------------------------------------------------------------------------- CFG


def test_cfg_conditional_offset_equals_standard_at_scale_plus_one():
    """cond + s*(cond - uncond) == uncond + (s+1)*(cond - uncond), and standard matches its formula (float64)."""
    uncond, cond = randn(*SHAPE, seed=60), randn(*SHAPE, seed=61)
    u, c = uncond.numpy(), cond.numpy()
    for scale in (0.5, 3.0, 7.5):
        offset = classifier_free_guidance(uncond, cond, scale, form="conditional_offset")
        standard = classifier_free_guidance(uncond, cond, scale + 1.0)
        assert rel_err(offset, standard.numpy()) < REL_TOL
        assert rel_err(standard, u + (scale + 1.0) * (c - u)) < REL_TOL
        assert rel_err(offset, c + scale * (c - u)) < REL_TOL


def test_cfg_standard_scale_one_returns_cond_exactly():
    """Standard CFG at scale 1 is no guidance: cond itself, bit for bit, even when uncond is garbage."""
    uncond = torch.full(SHAPE, math.inf, dtype=torch.bfloat16)
    cond = randn(*SHAPE, seed=62, dtype=torch.bfloat16)
    out = classifier_free_guidance(uncond, cond, 1.0)
    assert out is cond
    assert classifier_free_guidance(uncond, cond, 0.0, form="conditional_offset") is cond


def test_cfg_unknown_form_raises():
    """An unknown form raises a one-line error naming the value and the allowed forms."""
    x = torch.zeros(2)
    with pytest.raises(ValueError) as info:
        classifier_free_guidance(x, x, 1.0, form="cfg_plus")
    message = str(info.value)
    assert "\n" not in message and "form" in message and "'cfg_plus'" in message
    assert all(form in message for form in CFG_FORMS)


@settings(max_examples=50, deadline=None)
@given(scale=st.floats(-10.0, 10.0), seed=st.integers(0, 2**16))
def test_cfg_forms_agree_property(scale, seed):
    """For any scale the two forms are the same family shifted by one (float64)."""
    uncond, cond = randn(4, 3, seed=seed), randn(4, 3, seed=seed + 1)
    offset = classifier_free_guidance(uncond, cond, scale, form="conditional_offset")
    standard = classifier_free_guidance(uncond, cond, scale + 1.0, form="standard")
    assert rel_err(offset, standard.numpy()) < REL_TOL


# ----------------------------------------------------------------------------- noising and x0 conversions


def test_sigma_forms_broadcast_identically():
    """A python float, a 0-dim tensor and a (batch,) tensor of one value give the same x_t."""
    x0, eps = randn(*SHAPE, seed=70), randn(*SHAPE, seed=71)
    ref = 0.7 * x0.numpy() + 0.3 * eps.numpy()
    for sigma in (0.3, torch.tensor(0.3, dtype=torch.float64), torch.full((3,), 0.3, dtype=torch.float64)):
        assert rel_err(add_noise(x0, eps, sigma), ref) < REL_TOL


def test_add_noise_per_sample_sigma_matches_loop():
    """A (batch,) sigma applies sample b's level to sample b only."""
    x0, eps = randn(*SHAPE, seed=72), randn(*SHAPE, seed=73)
    sigma = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    ref = np.empty(SHAPE)
    for b, s in enumerate([0.1, 0.5, 0.9]):
        ref[b] = (1 - s) * x0.numpy()[b] + s * eps.numpy()[b]
    assert rel_err(add_noise(x0, eps, sigma), ref) < REL_TOL


def test_bad_sigma_shape_raises():
    """A sigma whose length is not the batch size, or with 2 dims, fails instead of broadcasting."""
    x0 = torch.zeros(SHAPE)
    for sigma in (torch.zeros(4), torch.zeros(3, 1)):
        with pytest.raises(ValueError) as info:
            add_noise(x0, x0, sigma)
        assert "\n" not in str(info.value) and "sigma" in str(info.value)


def test_velocity_round_trip_recovers_x0():
    """add_noise then x0_from_velocity(velocity_target) recovers x0, per-sample sigma, float64."""
    x0, eps = randn(*SHAPE, seed=74), randn(*SHAPE, seed=75)
    sigma = torch.tensor([0.02, 0.5, 0.98], dtype=torch.float64)
    x_t = add_noise(x0, eps, sigma)
    v = velocity_target(x0, eps)
    assert rel_err(v, eps.numpy() - x0.numpy()) < REL_TOL
    assert rel_err(x0_from_velocity(x_t, v, sigma), x0.numpy()) < REL_TOL


def test_epsilon_form_with_flow_alpha_equals_velocity_form():
    """x0_from_epsilon with alpha = 1 - sigma recovers x0 and agrees with the velocity form."""
    x0, eps = randn(*SHAPE, seed=76), randn(*SHAPE, seed=77)
    sigma = torch.tensor([0.1, 0.4, 0.8], dtype=torch.float64)
    x_t = add_noise(x0, eps, sigma)
    from_eps = x0_from_epsilon(x_t, eps, 1.0 - sigma, sigma)
    from_v = x0_from_velocity(x_t, velocity_target(x0, eps), sigma)
    assert rel_err(from_eps, x0.numpy()) < REL_TOL
    assert rel_err(from_eps, from_v.numpy()) < REL_TOL


def test_epsilon_form_general_interpolation():
    """With a VP schedule (alpha^2 + sigma^2 = 1) x0_from_epsilon inverts alpha*x0 + sigma*eps."""
    x0, eps = randn(*SHAPE, seed=78), randn(*SHAPE, seed=79)
    alpha, sigma = math.sqrt(0.3), math.sqrt(0.7)
    x_t = alpha * x0 + sigma * eps
    assert rel_err(x0_from_epsilon(x_t, eps, alpha, sigma), x0.numpy()) < REL_TOL
    with pytest.raises(ValueError, match="alpha"):
        x0_from_epsilon(x_t, eps, 0.0, 1.0)


# ----------------------------------------------------------------------------- losses


def test_fake_score_loss_matches_reference():
    """Unweighted: mean((v_pred - (eps - x0))^2); weighted: mean_b(w_b * mean_sample_b(err^2))."""
    v_pred, x0, eps = (randn(*SHAPE, seed=s) for s in (80, 81, 82))
    err = (v_pred.numpy() - (eps.numpy() - x0.numpy())) ** 2
    target = prediction_target("velocity", x0, eps)
    assert rel_err(fake_score_loss(v_pred, target), err.sum() / err.size) < REL_TOL
    weight = [0.5, 2.0, 0.0]
    ref = sum(w * err[b].sum() / err[b].size for b, w in enumerate(weight)) / 3
    out = fake_score_loss(v_pred, target, weight=torch.tensor(weight, dtype=torch.float64))
    assert rel_err(out, ref) < REL_TOL
    with pytest.raises(ValueError, match="weight"):
        fake_score_loss(v_pred, target, weight=torch.ones(4))


def test_fake_score_loss_upcasts_and_carries_graph():
    """bf16 predictions give a float32 loss that back-propagates into the prediction."""
    v_pred = randn(*SHAPE, seed=83, dtype=torch.bfloat16).requires_grad_(True)
    x0, eps = randn(*SHAPE, seed=84, dtype=torch.bfloat16), randn(*SHAPE, seed=85, dtype=torch.bfloat16)
    target = prediction_target("velocity", x0, eps)
    assert target.dtype == torch.float32  # the target is formed in float32 from bf16 inputs
    loss = fake_score_loss(v_pred, target)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    loss.backward()
    assert v_pred.grad is not None


def test_gan_losses_match_stable_reference():
    """Generator mean softplus(-D(fake)); discriminator mean softplus(D(fake)) + mean softplus(-D(real))."""
    fake = randn(6, seed=90) * 10
    real = randn(4, seed=91) * 10
    fake[0], real[0] = 40.0, -40.0  # far tails, where naive log(1 + exp(z)) overflows in float32
    f, r = fake.numpy(), real.numpy()
    assert rel_err(gan_generator_loss(fake), np_softplus(-f).mean()) < REL_TOL
    assert (
        rel_err(gan_discriminator_loss(fake, real), np_softplus(f).mean() + np_softplus(-r).mean()) < REL_TOL
    )
    assert gan_generator_loss(fake.to(torch.bfloat16)).dtype == torch.float32
    assert gan_discriminator_loss(fake.half(), real.half()).dtype == torch.float32


def test_regression_loss_matches_reference():
    """Plain float64 MSE, upcast to float32 for half inputs."""
    pred, target = randn(*SHAPE, seed=92), randn(*SHAPE, seed=93)
    assert rel_err(regression_loss(pred, target), ((pred.numpy() - target.numpy()) ** 2).mean()) < REL_TOL
    assert regression_loss(pred.half(), target.half()).dtype == torch.float32


# ----------------------------------------------------------------------------- sigma shift and sampling


def test_shift_sigma_reference_and_identity():
    """shift_sigma matches s*t/(1+(s-1)*t) per element, fixes 0 and 1, and shift 1 returns the input itself."""
    grid = [i / 20 for i in range(21)]
    sigma = torch.tensor(grid, dtype=torch.float64)
    for s in (0.5, 3.0):
        ref = [s * t / (1 + (s - 1) * t) for t in grid]
        out = shift_sigma(sigma, s)
        assert rel_err(out, ref) < REL_TOL
        assert out[0].item() == 0.0 and out[-1].item() == 1.0
        assert math.isclose(shift_sigma(0.25, s), ref[5], rel_tol=1e-12)
    assert shift_sigma(sigma, 1.0) is sigma
    assert shift_sigma(0.3, 1.0) == 0.3


@settings(max_examples=100, deadline=None)
@given(shift=st.floats(0.05, 20.0), a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0))
def test_shift_sigma_is_monotone_on_unit_interval(shift, a, b):
    """For any shift > 0 the map is non-decreasing and stays within [0, 1]."""
    lo, hi = min(a, b), max(a, b)
    s_lo, s_hi = shift_sigma(lo, shift), shift_sigma(hi, shift)
    assert 0.0 <= s_lo <= s_hi <= 1.0 + 1e-15


@pytest.mark.parametrize("shift", [0.0, -1.0, math.nan, math.inf])
def test_shift_sigma_rejects_bad_shift(shift):
    """Non-positive or non-finite shifts raise a one-line error naming the value."""
    with pytest.raises(ValueError) as info:
        shift_sigma(0.5, shift)
    assert "\n" not in str(info.value) and "shift" in str(info.value) and repr(shift) in str(info.value)


def test_sample_sigmas_range_and_dtype():
    """Draws lie in [shift(sigma_min), shift(sigma_max)], one per sample, in the requested dtype."""
    gen = torch.Generator().manual_seed(0)
    out = sample_sigmas(4096, generator=gen, sigma_min=0.02, sigma_max=0.98)
    assert out.shape == (4096,) and out.dtype == torch.float32
    assert out.min().item() >= 0.02 - 1e-7 and out.max().item() <= 0.98 + 1e-7
    assert out.max().item() - out.min().item() > 0.9  # actually spans the range
    shifted = sample_sigmas(
        4096, generator=gen, sigma_min=0.02, sigma_max=0.98, shift=3.0, dtype=torch.float64
    )
    assert shifted.dtype == torch.float64
    lo, hi = shift_sigma(0.02, 3.0), shift_sigma(0.98, 3.0)
    assert shifted.min().item() >= lo and shifted.max().item() <= hi
    assert shifted.mean().item() > out.mean().item()  # shift > 1 moves mass to high noise


def test_sample_sigmas_shift_is_applied_to_the_same_draw():
    """With the same seed, the shifted draw is shift_sigma of the unshifted one."""
    plain = sample_sigmas(
        16, generator=torch.Generator().manual_seed(5), sigma_min=0.0, sigma_max=1.0, dtype=torch.float64
    )
    shifted = sample_sigmas(
        16,
        generator=torch.Generator().manual_seed(5),
        sigma_min=0.0,
        sigma_max=1.0,
        shift=3.0,
        dtype=torch.float64,
    )
    ref = [3 * t / (1 + 2 * t) for t in plain.tolist()]
    assert rel_err(shifted, ref) < REL_TOL


def test_sample_sigmas_determinism():
    """Same seed gives identical draws; a different seed gives different draws."""

    def draw(seed):
        return sample_sigmas(8, generator=torch.Generator().manual_seed(seed), sigma_min=0.1, sigma_max=0.9)

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"sigma_min": -0.1, "sigma_max": 0.5}, "sigma_min"),
        ({"sigma_min": 0.1, "sigma_max": 1.5}, "sigma_max"),
        ({"sigma_min": 0.6, "sigma_max": 0.5}, "sigma_min"),
        ({"sigma_min": 0.1, "sigma_max": 0.5, "shift": 0.0}, "shift"),
    ],
)
def test_sample_sigmas_rejects_bad_ranges(kwargs, word):
    """Ranges outside 0 <= sigma_min <= sigma_max <= 1 (or a bad shift) raise one-line errors naming the value."""
    with pytest.raises(ValueError) as info:
        sample_sigmas(2, generator=torch.Generator(), **kwargs)
    message = str(info.value)
    assert "\n" not in message and word in message
    assert any(repr(v) in message for v in kwargs.values())


# ----------------------------------------------------------------------------- student schedule


@pytest.mark.parametrize("num_steps", [1, 2, 4, 8, 50])
def test_student_schedule_shape_and_order(num_steps):
    """Length num_steps + 1, float32, strictly decreasing, first entry sigma_max, last entry exactly 0."""
    for shift in (1.0, 3.0):
        out = student_sigma_schedule(num_steps, shift=shift)
        assert out.shape == (num_steps + 1,) and out.dtype == torch.float32
        assert out[0].item() == 1.0 and out[-1].item() == 0.0
        assert bool((out[:-1] > out[1:]).all())


def test_student_schedule_four_steps_unshifted():
    """The DMD2 SDXL 4-step schedule: [1, .75, .5, .25, 0] exactly."""
    assert student_sigma_schedule(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_student_schedule_shift_and_sigma_max_match_reference():
    """shift=3 and sigma_max=0.9 give shift_sigma of the float64 linspace, element by element."""
    for sigma_max in (1.0, 0.9):
        base = [sigma_max * (1 - i / 4) for i in range(5)]
        ref = [3 * t / (1 + 2 * t) for t in base]
        out = student_sigma_schedule(4, shift=3.0, sigma_max=sigma_max)
        assert rel_err(out, ref) < REL_TOL  # float32 storage of float64 values


def test_student_schedule_explicit_sigmas_verbatim():
    """Explicit sigmas are used as given (no shift) with 0.0 appended."""
    sigmas = [0.999, 0.749, 0.499, 0.249]
    out = student_sigma_schedule(4, sigmas=sigmas, shift=3.0)
    assert torch.equal(out, torch.tensor([*sigmas, 0.0], dtype=torch.float32))


@pytest.mark.parametrize(
    ("sigmas", "words"),
    [
        ([1.0, 0.5, 0.25], ["sigmas", "3", "4"]),
        ([1.0, 0.5, 0.6, 0.25], ["sigmas[2]", "0.6", "decreasing"]),
        ([1.0, 0.5, 0.5, 0.25], ["sigmas[2]", "0.5", "decreasing"]),
        ([1.2, 0.5, 0.4, 0.25], ["sigmas[0]", "1.2", "(0, 1]"]),
        ([1.0, 0.5, 0.25, 0.0], ["sigmas[3]", "0.0", "(0, 1]"]),
        ([1.0, 0.5, 0.25, -0.1], ["sigmas[3]", "-0.1"]),
    ],
)
def test_student_schedule_rejects_bad_explicit_sigmas(sigmas, words):
    """Wrong length, non-decreasing, > 1 or <= 0 explicit sigmas raise one-line errors naming value and position."""
    with pytest.raises(ValueError) as info:
        student_sigma_schedule(4, sigmas=sigmas)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": 4, "sigma_max": 0.0}, "sigma_max"),
        ({"num_steps": 4, "shift": -2.0}, "shift"),
    ],
)
def test_student_schedule_rejects_bad_arguments(kwargs, word):
    """num_steps < 1, sigma_max outside (0, 1] and a bad shift raise one-line errors naming the argument."""
    with pytest.raises(ValueError) as info:
        student_sigma_schedule(**kwargs)
    assert "\n" not in str(info.value) and word in str(info.value)


def test_module_imports_only_torch_and_stdlib():
    """Layer 1: the module imports only torch, math, dataclasses and typing."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(losses))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= {"__future__", "torch", "math", "dataclasses", "typing"}, roots
