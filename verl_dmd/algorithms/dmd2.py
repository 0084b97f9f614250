"""The DMD2 phase computer: student (distribution matching) and fake-score (denoising) phases.

Conventions are those of docs/dmd2.md; the math is `verl_dmd.losses`.

Batch contract (per rank, split into micro-batches by the runtime):
- ``noise``: the student's starting noise, shape (B, *latent); the data provider
  makes it, so it can be a pure function of the sample's position (resumable).
- ``cond.<name>``: conditioning tensors passed to the model adapter.
- ``uncond.<name>``: the unconditional inputs, required when teacher guidance is on.
- ``real.x0``, ``real.cond.<name>``: real data with its conditioning, required in
  fake-score phases when ``gan_discriminator_weight > 0``.
- ``regression.noise``, ``regression.target``, ``regression.cond.<name>``: paired
  (noise, teacher sample, conditioning) data, required when ``regression_weight > 0``;
  the student's *first* step from that noise is regressed onto the target (MSE), so a
  multi-step student's 1-step output is what the term shapes.

Randomness drawn here, in this order per micro-batch, from generators whose state
is in `state_dict()`:
1. the exit index of backward simulation (multi-step students), from the
   *shared* generator seeded identically on every rank, so all ranks agree;
2. per simulated step before the exit, the re-noising noise (local generator);
3. in a student phase, the noise level per sample, then the noise ``eps`` (the GAN
   generator term reuses both); in a fake-score phase, the same two draws from the
   fake-score range, then (with the GAN discriminator) the real data's noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from verl_dmd import losses
from verl_dmd.adapters.base import DistributionMatchingModelAdapter
from verl_dmd.phases import PhaseOutput, PhaseRequest, Role
from verl_dmd.plan import AlgorithmSpec

COND, UNCOND, REGRESSION, REAL = "cond.", "uncond.", "regression.", "real."


def _prefixed(batch: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in batch.items() if k.startswith(prefix)}


def _to_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor on `like`'s device and dtype, converted on the host (as a blocking copy converts).

    To a GPU it goes through pinned memory without waiting: a copy from pageable memory makes the
    host wait until the device has run everything queued before it, and the device then idles while
    the host prepares the next work (the noise draws of a phase took ~60 ms a phase at batch 8).
    """
    tensor = tensor.to(like.dtype)
    if like.device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(like.device, non_blocking=True)
    return tensor.to(like.device)


def _draw(shape, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise from a CPU generator, moved to `like`'s device and dtype."""
    return _to_like(torch.randn(shape, generator=generator, dtype=torch.float32), like)


class GanHead(nn.Module):
    """DMD2's discriminator head on fake-score features: mean over tokens, norm, a 2-layer MLP, one logit.

    It is a parameter group of the fake-score role (trained by the fake-score
    optimizer); the role engine attaches it to the model that holds the fake score.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, 1) (not squeezed: FSDP2 warns about view outputs of its units)."""
        if features.ndim > 2:  # (B, tokens..., D): pool every token
            features = features.flatten(1, -2).mean(dim=1)
        return self.mlp(self.norm(features))


class DMD2Computer:
    """Computes one micro-batch of a DMD2 student or fake-score phase; see the module docstring."""

    def __init__(
        self, adapter: DistributionMatchingModelAdapter, algorithm: AlgorithmSpec, *, seed: int, rank: int
    ) -> None:
        if algorithm.student_steps > 1 and not algorithm.backward_simulation:
            raise ValueError(
                "config key 'algorithm.backward_simulation' = False: not supported by this version's DMD2 "
                "computer (multi-step training on noised real data is not built); fix: leave it at true"
            )
        self.adapter = adapter
        self.algorithm = algorithm
        self.seed = seed
        self.rank = rank
        self.local = torch.Generator().manual_seed(seed * 1_000_003 + 1 + rank)
        self.shared = torch.Generator().manual_seed(seed * 1_000_003)
        self.schedule = losses.student_sigma_schedule(
            algorithm.student_steps, shift=algorithm.sigma_shift, sigmas=algorithm.student_sigmas
        )

    # ------------------------------------------------------------------ sampling

    def exit_index(self) -> int:
        """Backward simulation: the step that runs with grad, the same on every rank."""
        if self.algorithm.student_steps == 1:
            return 0
        return int(torch.randint(self.algorithm.student_steps, (1,), generator=self.shared).item())

    def student_sample(
        self, module, noise: torch.Tensor, cond: Mapping[str, Any], *, exit_index: int, grad: bool
    ) -> torch.Tensor:
        """The student's x0 estimate at step `exit_index` of its schedule, starting from `noise`.

        Steps before the exit run without grad (predict x0, re-noise with fresh noise
        to the next level); the exit step runs with grad if `grad`.
        """
        x_t = noise
        batch = noise.shape[0]
        for step in range(exit_index + 1):
            sigma = _to_like(self.schedule[step], noise).expand(batch)
            with torch.set_grad_enabled(grad and step == exit_index):
                velocity = self.adapter.predict(module, x_t, sigma, cond)
                x0 = losses.x0_from_velocity(x_t, velocity, sigma)
            if step < exit_index:
                next_sigma = _to_like(self.schedule[step + 1], noise).expand(batch)
                x_t = losses.add_noise(x0.detach(), _draw(noise.shape, self.local, noise), next_sigma)
        return x0

    def _sigmas(self, batch: int, low: float, high: float, like: torch.Tensor) -> torch.Tensor:
        sigma = losses.sample_sigmas(
            batch, generator=self.local, sigma_min=low, sigma_max=high, shift=self.algorithm.sigma_shift
        )
        return _to_like(sigma, like)

    # ------------------------------------------------------------------ phases

    def compute_phase(
        self, request: PhaseRequest, batch, runtime, *, micro_batch_index: int, num_micro_batches: int
    ) -> PhaseOutput:
        if request.role is Role.STUDENT:
            return self._student_phase(batch, runtime)
        return self._fake_score_phase(batch, runtime)

    def _student_phase(self, batch, runtime) -> PhaseOutput:
        alg = self.algorithm
        noise, cond = batch["noise"], _prefixed(batch, COND)
        exit_index = self.exit_index()
        x = self.student_sample(
            runtime.engine.module_for(Role.STUDENT), noise, cond, exit_index=exit_index, grad=True
        )
        sigma = self._sigmas(x.shape[0], alg.sigma_min, alg.sigma_max, x)
        eps = _draw(x.shape, self.local, x)
        with torch.no_grad():
            x_t = losses.add_noise(x.detach(), eps, sigma)
            with runtime.use_role(Role.FAKE_SCORE) as fake:
                x0_fake = losses.x0_from_velocity(x_t, self.adapter.predict(fake, x_t, sigma, cond), sigma)
            with runtime.use_role(Role.TEACHER) as teacher:
                v_cond = self.adapter.predict(teacher, x_t, sigma, cond)
                if self._guided:
                    v_uncond = self.adapter.predict(teacher, x_t, sigma, self._uncond(batch))
                    v_cond = losses.classifier_free_guidance(
                        v_uncond, v_cond, alg.teacher_guidance_scale, alg.cfg_form
                    )
            x0_real = losses.x0_from_velocity(x_t, v_cond, sigma)
        dmd = losses.dmd_gradient(
            x, x0_fake, x0_real, normalizer=alg.dmd_normalizer, eps=alg.dmd_normalizer_eps
        )
        loss = losses.generator_surrogate_loss(x, dmd.grad)
        metrics = {
            "dmd_loss": loss.detach(),
            "dmd_nonfinite": dmd.nonfinite,
            "dmd_normalizer": dmd.normalizer.mean(),
            "exit_index": float(exit_index),
        }
        if alg.gan_generator_weight > 0:
            generator, grad_x = self._gan_generator_gradient(x.detach(), eps, sigma, cond, runtime)
            metrics["gan_generator_loss"] = generator
            # Like the DMD term, a surrogate whose gradient in x is dL_g/dx: the backward through the
            # frozen fake score runs here, inside its role, not in the student's backward.
            wide = torch.promote_types(x.dtype, torch.float32)  # float32 or wider, as the DMD term
            loss = loss + alg.gan_generator_weight * (x.to(wide) * grad_x.to(wide)).sum()
        if alg.regression_weight > 0:
            regression = self._regression_loss(batch, runtime.engine.module_for(Role.STUDENT))
            metrics["regression_loss"] = regression.detach()
            loss = loss + alg.regression_weight * regression
        return PhaseOutput(loss=loss, metrics=metrics)

    def _gan_generator_gradient(self, x, eps, sigma, cond, runtime) -> tuple[torch.Tensor, torch.Tensor]:
        """L_g = mean softplus(-D(x_t)) at the DMD term's noise level and eps, and dL_g/dx."""
        x = x.requires_grad_(True)
        with runtime.use_role(Role.FAKE_SCORE) as fake, torch.enable_grad():
            _, features = self.adapter.predict_with_features(
                fake, losses.add_noise(x, eps, sigma), sigma, cond
            )
            generator = losses.gan_generator_loss(runtime.engine.gan_head(features))
            (grad_x,) = torch.autograd.grad(generator, x)
        return generator.detach(), grad_x

    def _regression_loss(self, batch, student) -> torch.Tensor:
        """DMD v1's term: the student's first-step x0 from paired noise against the teacher's sample."""
        pairs = _prefixed(batch, REGRESSION)
        missing = [k for k in ("noise", "target") if k not in pairs]
        if missing:
            raise ValueError(
                f"algorithm.regression_weight = {self.algorithm.regression_weight} needs paired data, but the "
                f"batch has no {', '.join(REGRESSION + k for k in missing)}; fix: give the data provider "
                "data.regression_pairs_path, or set algorithm.regression_weight=0"
            )
        x = self.student_sample(student, pairs["noise"], _prefixed(pairs, COND), exit_index=0, grad=True)
        return losses.regression_loss(x, pairs["target"])

    def _fake_score_phase(self, batch, runtime) -> PhaseOutput:
        alg = self.algorithm
        noise, cond = batch["noise"], _prefixed(batch, COND)
        exit_index = self.exit_index()
        with torch.no_grad(), runtime.use_role(Role.STUDENT) as student:
            x = self.student_sample(student, noise, cond, exit_index=exit_index, grad=False)
        sigma = self._sigmas(x.shape[0], alg.fake_sigma_min, alg.fake_sigma_max, x)
        eps = _draw(x.shape, self.local, x)
        x_t = losses.add_noise(x, eps, sigma)
        fake = runtime.engine.module_for(Role.FAKE_SCORE)
        if alg.gan_discriminator_weight == 0:
            velocity = self.adapter.predict(fake, x_t, sigma, cond)
            loss = losses.fake_score_loss(velocity, x, eps)
            return PhaseOutput(loss=loss, metrics={"fake_loss": loss.detach()})
        # DMD2's discriminator: the head on fake-score features, student samples vs real data noised
        # to the same levels; it trains the head and the fake score together.
        real = _prefixed(batch, REAL)
        if "x0" not in real:
            raise ValueError(
                f"algorithm.gan_discriminator_weight = {alg.gan_discriminator_weight} needs real data, but the "
                "batch has no real.x0; fix: use a data provider with real samples (digits has them), or set "
                "the GAN weights to 0"
            )
        velocity, fake_features = self.adapter.predict_with_features(fake, x_t, sigma, cond)
        denoise = losses.fake_score_loss(velocity, x, eps)
        x_real = real["x0"]
        x_t_real = losses.add_noise(x_real, _draw(x_real.shape, self.local, x_real), sigma)
        _, real_features = self.adapter.predict_with_features(fake, x_t_real, sigma, _prefixed(real, COND))
        head = runtime.engine.gan_head
        discriminator = losses.gan_discriminator_loss(head(fake_features), head(real_features))
        loss = denoise + alg.gan_discriminator_weight * discriminator
        metrics = {"fake_loss": denoise.detach(), "gan_discriminator_loss": discriminator.detach()}
        return PhaseOutput(loss=loss, metrics=metrics)

    @property
    def _guided(self) -> bool:
        alg = self.algorithm
        return alg.teacher_guidance_scale != (1.0 if alg.cfg_form == "standard" else 0.0)

    @staticmethod
    def _uncond(batch) -> dict[str, Any]:
        uncond = _prefixed(batch, UNCOND)
        if not uncond:
            raise ValueError(
                "algorithm.teacher_guidance_scale asks for classifier-free guidance but the batch has no "
                "'uncond.*' inputs; fix: have the data provider emit unconditional inputs, or set the scale to 1"
            )
        return uncond

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Generator states as uint8 tensors (loadable with torch.load(weights_only=True))."""
        return {"local": self.local.get_state(), "shared": self.shared.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.local.set_state(state["local"])
        self.shared.set_state(state["shared"])

    def reseed(self, salt: int) -> None:
        """New streams for a resume at another world size (the saved per-rank streams do not map).

        Hashed from (seed, salt, rank), so they neither repeat the run's first draws
        nor collide across ranks; the shared stream stays equal on every rank.
        """
        from verl_dmd.checkpoint.composite import stream_seed

        self.local.manual_seed(stream_seed(self.seed, "dmd2.local", salt, self.rank))
        self.shared.manual_seed(stream_seed(self.seed, "dmd2.shared", salt))
