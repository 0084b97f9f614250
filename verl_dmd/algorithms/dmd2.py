"""The DMD2 phase computer: student (distribution matching) and fake-score (denoising) phases.

Conventions are those of docs/dmd2.md; the math is `verl_dmd.losses`, the samplers
`verl_dmd.algorithms.sampling`, and every conversion between the model's prediction,
x0 and noise goes through the model adapter's parameterization. Registered as
``algorithm.name=dmd2``.

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
   *shared* generator seeded identically on every rank, so all ranks agree (one
   integer; with ``first_exit_probability`` a uniform number, then for a later
   step an integer);
2. per simulated step before the exit, the re-noising noise (local generator);
3. in a student phase, the noise level per sample, then the noise ``eps`` (the GAN
   generator term reuses both); in a fake-score phase, the same two draws from the
   fake-score range, then (with the GAN discriminator) the real data's noise. With
   ``gan_sigma_max`` the GAN draws its own: in a student phase a level and a noise
   after the DMD term's; in a fake-score phase a level and a noise for the fake
   input, then a level and (as above) a noise for the real one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from verl_dmd import losses
from verl_dmd.algorithms.registry import register_method
from verl_dmd.algorithms.sampling import draw_normal, student_sample, to_like, trained_schedule
from verl_dmd.batch import prefixed
from verl_dmd.phases import ExtraModule, PhaseOutput, PhaseRequest, PhaseRuntime, Role
from verl_dmd.seeding import generator, stream_seed

COND, UNCOND, REGRESSION, REAL = "cond.", "uncond.", "regression.", "real."

GAN_HEAD = "dmd_gan_head"
"""Submodule name of the GAN head on the model that holds the fake score (checkpoint keys contain it); with
``algorithm.gan_heads=per_exit_group`` the head of the first step's samples."""
GAN_HEAD_LATER = "dmd_gan_head_later"
"""With ``algorithm.gan_heads=per_exit_group`` and a multi-step student: the head of the later steps' samples."""


class GanHead(nn.Module):
    """The pooled discriminator head (`algorithm.gan_head=pooled`): mean over tokens, norm, a 2-layer MLP, one logit.

    It cannot see where things are in the image; on the digits it stays near chance
    (docs/benchmarks.md, issue 21). Kept for checkpoints written before the conv head.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, features: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """Logits of shape (B, 1) (not squeezed: FSDP2 warns about view outputs of its units)."""
        if features.ndim > 2:  # (B, tokens..., D): pool every token
            features = features.flatten(1, -2).mean(dim=1)
        return self.mlp(self.norm(features))


class ConvGanHead(nn.Module):
    """DMD2's convolutional discriminator head (`algorithm.gan_head=conv`) on fake-score features.

    The image tokens (B, N, D) are normed, projected to ``width`` channels and laid
    on their grid (rows, cols), or (frames, rows, cols) with frames folded into the
    batch; two stride-2 3x3 convolutions (GroupNorm, SiLU) follow, then a mean over
    what remains of the grid and a linear layer to one logit. It sees the layout
    of the image, which a mean over tokens loses. A parameter group of the
    fake-score role, as `GanHead`.
    """

    def __init__(self, dim: int, width: int | None = None) -> None:
        super().__init__()
        width = width or min(dim, 256)
        groups = math.gcd(width, 8)
        self.width = width
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, width)
        self.down = nn.Sequential(
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.GroupNorm(groups, width),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.GroupNorm(groups, width),
            nn.SiLU(),
        )
        self.out = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor, grid: tuple[int, ...] | None = None) -> torch.Tensor:
        """Logits of shape (B, 1) from features (B, N, D) whose N tokens lie row-major on `grid`."""
        if grid is None or features.ndim != 3 or math.prod(grid) != features.shape[1]:
            shape = tuple(features.shape)
            raise ValueError(
                f"the conv GAN head needs image tokens (B, N, D) on a grid of N tokens; got features {shape} "
                f"and grid {grid}; fix: override the adapter's gan_feature_grid, or set algorithm.gan_head=pooled"
            )
        batch = features.shape[0]
        *frames, rows, cols = grid
        x = self.proj(self.norm(features))
        x = x.reshape(batch * math.prod(frames), rows, cols, self.width).permute(0, 3, 1, 2)
        x = self.down(x).mean(dim=(2, 3)).reshape(batch, -1, self.width).mean(dim=1)
        return self.out(x)


GAN_HEADS = {"pooled": GanHead, "conv": ConvGanHead}


@register_method("dmd2")
class DMD2Computer:
    """Computes one micro-batch of a DMD2 student or fake-score phase; see the module docstring."""

    @classmethod
    def from_plan(cls, adapter, model_config, plan, *, rank: int) -> DMD2Computer:
        """The computer of `plan.algorithm` for `adapter`'s family (`model_config`: the plan's model
        section, which DMD2 does not read: its math is the same for every layout)."""
        return cls(adapter, plan.algorithm, seed=plan.trainer.seed, rank=rank)

    def __init__(self, adapter, algorithm, *, seed: int, rank: int) -> None:
        if algorithm.student_steps > 1 and not algorithm.backward_simulation:
            raise ValueError(
                "config key 'algorithm.backward_simulation' = False: not supported by this version's DMD2 "
                "computer (multi-step training on noised real data is not built); fix: leave it at true"
            )
        self._check_levels(adapter, algorithm)
        top = float(adapter.sigma_max)
        self.adapter = adapter
        self.algorithm = algorithm
        self.seed = seed
        self.rank = rank
        self.local = generator(seed, "dmd2.local", rank)
        self.shared = generator(seed, "dmd2.shared")
        self.schedule = trained_schedule(algorithm, top)
        # the teacher's CFG scale in the standard form: 1 means no guidance (no unconditional forward)
        self.guidance = losses.standard_guidance_scale(algorithm.teacher_guidance_scale, algorithm.cfg_form)

    @staticmethod
    def _check_levels(adapter, algorithm) -> None:
        """Refuse noise levels the family cannot read x0 from, and a fake-score weighting that is infinite in
        the fake score's range (each a one-line error naming the key)."""
        top = float(adapter.sigma_max)
        family = f"model adapter {adapter.name!r} ({adapter.parameterization} prediction)"
        if algorithm.student_sigmas is not None and algorithm.student_sigmas[0] > top:
            raise ValueError(
                f"config key 'algorithm.student_sigmas' = {list(algorithm.student_sigmas)}: {family} samples "
                f"from noise levels up to {top}; fix: start the schedule at or below {top}, or leave it null"
            )
        if algorithm.sigma_max > top:
            raise ValueError(
                f"config key 'algorithm.sigma_max' = {algorithm.sigma_max}: {family} reads x0 from noise levels "
                f"up to {top}; fix: set algorithm.sigma_max <= {top}"
            )
        ends = torch.tensor([algorithm.fake_sigma_min, algorithm.fake_sigma_max], dtype=torch.float64)
        weight = adapter.fake_score_weight(algorithm.fake_score_weighting, ends)
        if weight is not None and not bool(torch.isfinite(weight).all()):
            key, value = (
                ("fake_sigma_min", algorithm.fake_sigma_min)
                if not torch.isfinite(weight[0])
                else ("fake_sigma_max", algorithm.fake_sigma_max)
            )
            raise ValueError(
                f"config key 'algorithm.{key}' = {value}: the {algorithm.fake_score_weighting} weighting of "
                f"{family} is infinite there; fix: move algorithm.{key} inside (0, 1), or "
                "algorithm.fake_score_weighting=uniform"
            )

    def extra_modules(self) -> tuple[ExtraModule, ...]:
        """The GAN head, when the discriminator term is on: a fake-score module on the fake score's model; with
        ``gan_heads=per_exit_group`` and more than one student step, a second one for the later steps."""
        if self.algorithm.gan_discriminator_weight == 0:
            return ()
        adapter, head = self.adapter, GAN_HEADS[self.algorithm.gan_head]
        names = (GAN_HEAD, GAN_HEAD_LATER) if self._per_exit_heads else (GAN_HEAD,)
        return tuple(
            ExtraModule(name, Role.FAKE_SCORE, lambda model: head(adapter.gan_feature_dim(model)))
            for name in names
        )

    @property
    def _per_exit_heads(self) -> bool:
        return self.algorithm.gan_heads == "per_exit_group" and self.algorithm.student_steps > 1

    def _gan_head(self, runtime: PhaseRuntime, exit_index: int) -> nn.Module:
        """The discriminator head of samples from student step `exit_index`: the one head, or per exit group
        (the first step's, or the later steps' shared one)."""
        later = self._per_exit_heads and exit_index > 0
        return runtime.extra_module(GAN_HEAD_LATER if later else GAN_HEAD)

    def _per_head(self, name: str, value: torch.Tensor, exit_index: int) -> dict[str, torch.Tensor]:
        """With a head per exit group, `value` also under the name of its head's group: the runtime averages
        a metric over the micro-batches that report it, so each head's loss is its own mean, where the plain
        name mixes the two heads as the micro-batches drew them."""
        if not self._per_exit_heads:
            return {}
        return {f"{name}_{'later_steps' if exit_index > 0 else 'first_step'}": value}

    # ------------------------------------------------------------------ sampling

    def exit_index(self) -> int:
        """Backward simulation: the step that runs with grad, the same on every rank."""
        steps, first = self.algorithm.student_steps, self.algorithm.first_exit_probability
        if steps == 1:
            return 0
        if first is None:  # every step equally likely (DMD2)
            return int(torch.randint(steps, (1,), generator=self.shared).item())
        if float(torch.rand(1, generator=self.shared).item()) < first:
            return 0
        return 1 + int(torch.randint(steps - 1, (1,), generator=self.shared).item())

    def student_sample(
        self, module, noise: torch.Tensor, cond: Mapping[str, Any], *, exit_index: int, grad: bool
    ) -> torch.Tensor:
        """The student's x0 estimate at step `exit_index` of its schedule, starting from `noise`; the
        re-noising before the exit draws from the per-rank generator."""

        def renoise(step: int, x0: torch.Tensor) -> torch.Tensor:
            return draw_normal(noise.shape, self.local, noise)

        return student_sample(
            self.adapter, module, noise, cond, self.schedule, renoise=renoise, last=exit_index, grad=grad
        )

    def _sigmas(self, batch: int, low: float, high: float, like: torch.Tensor) -> torch.Tensor:
        sigma = losses.sample_sigmas(
            batch, generator=self.local, sigma_min=low, sigma_max=high, shift=self.algorithm.sigma_shift
        )
        return to_like(sigma, like)

    # ------------------------------------------------------------------ phases

    def compute_phase(
        self,
        request: PhaseRequest,
        batch,
        runtime: PhaseRuntime,
        *,
        micro_batch_index: int,
        num_micro_batches: int,
    ) -> PhaseOutput:
        if request.role is Role.STUDENT:
            return self._student_phase(batch, runtime, request.global_step + 1)
        return self._fake_score_phase(batch, runtime)

    def regression_weight_at(self, step: int) -> float:
        """The regression term's weight at student step `step` (counted from 1): `regression_weight`, or with
        `regression_decay_steps` N falling linearly to 0 at step N (DMD2's GAN on real data takes over)."""
        alg = self.algorithm
        if alg.regression_decay_steps is None:
            return alg.regression_weight
        return alg.regression_weight * max(0.0, 1.0 - step / alg.regression_decay_steps)

    def _student_phase(self, batch, runtime: PhaseRuntime, step: int) -> PhaseOutput:
        alg, adapter = self.algorithm, self.adapter
        noise, cond = batch["noise"], prefixed(batch, COND)
        exit_index = self.exit_index()
        student = runtime.module_for(Role.STUDENT)
        x = self.student_sample(student, noise, cond, exit_index=exit_index, grad=True)
        sigma = self._sigmas(x.shape[0], alg.sigma_min, alg.sigma_max, x)
        eps = draw_normal(x.shape, self.local, x)
        with torch.no_grad():
            x_t = adapter.add_noise(x.detach(), eps, sigma)
            with runtime.use_role(Role.FAKE_SCORE) as fake:
                x0_fake = adapter.to_x0(x_t, adapter.predict(fake, x_t, sigma, cond), sigma)
            with runtime.use_role(Role.TEACHER) as teacher:
                real = adapter.predict(teacher, x_t, sigma, cond)
                if self.guidance != 1.0:
                    real = losses.classifier_free_guidance(
                        adapter.predict(teacher, x_t, sigma, self._uncond(batch)),
                        real,
                        alg.teacher_guidance_scale,
                        alg.cfg_form,
                    )
            x0_real = adapter.to_x0(x_t, real, sigma)
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
            if alg.gan_sigma_max is not None:  # the GAN's own levels and noise, after the DMD term's draws
                sigma = self._sigmas(x.shape[0], 0.0, alg.gan_sigma_max, x)
                eps = draw_normal(x.shape, self.local, x)
            head = self._gan_head(runtime, exit_index)
            generator, grad_x = self._gan_generator_gradient(x.detach(), eps, sigma, cond, runtime, head)
            metrics["gan_generator_loss"] = generator
            metrics.update(self._per_head("gan_generator_loss", generator, exit_index))
            # Like the DMD term, a surrogate whose gradient in x is dL_g/dx: the backward through the
            # frozen fake score runs here, inside its role, not in the student's backward.
            wide = torch.promote_types(x.dtype, torch.float32)  # float32 or wider, as the DMD term
            loss = loss + alg.gan_generator_weight * (x.to(wide) * grad_x.to(wide)).sum()
        weight = self.regression_weight_at(step)
        if weight > 0:
            regression = self._regression_loss(batch, student)
            metrics["regression_loss"] = regression.detach()
            loss = loss + weight * regression
        return PhaseOutput(loss=loss, metrics=metrics)

    def _gan_generator_gradient(self, x, eps, sigma, cond, runtime: PhaseRuntime, head: nn.Module):
        """L_g = mean softplus(-D(x_t)) at the given level and eps (the DMD term's, or the GAN's own with
        gan_sigma_max), D reading `head`, and dL_g/dx."""
        x = x.requires_grad_(True)
        with runtime.use_role(Role.FAKE_SCORE) as fake, torch.enable_grad():
            x_t = self.adapter.add_noise(x, eps, sigma)
            _, features = self.adapter.predict_with_features(fake, x_t, sigma, cond)
            logits = head(features, self.adapter.gan_feature_grid(x_t, features))
            generator = losses.gan_generator_loss(logits)
            (grad_x,) = torch.autograd.grad(generator, x)
        return generator.detach(), grad_x

    def _regression_loss(self, batch, student) -> torch.Tensor:
        """DMD v1's term: the student's first-step x0 from paired noise against the teacher's sample."""
        pairs = prefixed(batch, REGRESSION)
        missing = [k for k in ("noise", "target") if k not in pairs]
        if missing:
            raise ValueError(
                f"algorithm.regression_weight = {self.algorithm.regression_weight} needs paired data, but the "
                f"batch has no {', '.join(REGRESSION + k for k in missing)}; fix: give the data provider "
                "data.regression_pairs_path, or set algorithm.regression_weight=0"
            )
        x = self.student_sample(student, pairs["noise"], prefixed(pairs, COND), exit_index=0, grad=True)
        return losses.regression_loss(x, pairs["target"])

    def _fake_score_phase(self, batch, runtime: PhaseRuntime) -> PhaseOutput:
        alg, adapter = self.algorithm, self.adapter
        noise, cond = batch["noise"], prefixed(batch, COND)
        exit_index = self.exit_index()
        with torch.no_grad(), runtime.use_role(Role.STUDENT) as student:
            x = self.student_sample(student, noise, cond, exit_index=exit_index, grad=False)
        sigma = self._sigmas(x.shape[0], alg.fake_sigma_min, alg.fake_sigma_max, x)
        eps = draw_normal(x.shape, self.local, x)
        x_t = adapter.add_noise(x, eps, sigma)
        fake = runtime.module_for(Role.FAKE_SCORE)
        weight = adapter.fake_score_weight(alg.fake_score_weighting, sigma)
        if alg.gan_discriminator_weight == 0:
            prediction = adapter.predict(fake, x_t, sigma, cond)
            loss = losses.fake_score_loss(prediction, adapter.prediction_target(x, eps, sigma), weight)
            return PhaseOutput(loss=loss, metrics={"fake_loss": loss.detach()})
        # DMD2's discriminator: the head on fake-score features, student samples vs real data noised
        # to the same levels; it trains the head and the fake score together.
        real = prefixed(batch, REAL)
        if "x0" not in real:
            raise ValueError(
                f"algorithm.gan_discriminator_weight = {alg.gan_discriminator_weight} needs real data, but the "
                "batch has no real.x0; fix: use a data provider with real samples (digits has them), or set "
                "the GAN weights to 0"
            )
        x_real = real["x0"]
        if alg.gan_sigma_max is None:  # the discriminator reads the denoising forward's features
            prediction, fake_features = adapter.predict_with_features(fake, x_t, sigma, cond)
            real_sigma, x_t_fake = sigma, x_t
        else:  # its own levels: fake then real, each a level and a noise
            prediction = adapter.predict(fake, x_t, sigma, cond)
            gan_sigma = self._sigmas(x.shape[0], 0.0, alg.gan_sigma_max, x)
            x_t_fake = adapter.add_noise(x, draw_normal(x.shape, self.local, x), gan_sigma)
            _, fake_features = adapter.predict_with_features(fake, x_t_fake, gan_sigma, cond)
            real_sigma = self._sigmas(x_real.shape[0], 0.0, alg.gan_sigma_max, x_real)
        denoise = losses.fake_score_loss(prediction, adapter.prediction_target(x, eps, sigma), weight)
        x_t_real = adapter.add_noise(x_real, draw_normal(x_real.shape, self.local, x_real), real_sigma)
        _, real_features = adapter.predict_with_features(fake, x_t_real, real_sigma, prefixed(real, COND))
        head = self._gan_head(runtime, exit_index)
        discriminator = losses.gan_discriminator_loss(
            head(fake_features, adapter.gan_feature_grid(x_t_fake, fake_features)),
            head(real_features, adapter.gan_feature_grid(x_t_real, real_features)),
        )
        loss = denoise + alg.gan_discriminator_weight * discriminator
        metrics = {"fake_loss": denoise.detach(), "gan_discriminator_loss": discriminator.detach()}
        metrics.update(self._per_head("gan_discriminator_loss", discriminator.detach(), exit_index))
        return PhaseOutput(loss=loss, metrics=metrics)

    @staticmethod
    def _uncond(batch) -> dict[str, Any]:
        uncond = prefixed(batch, UNCOND)
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
        self.local.manual_seed(stream_seed(self.seed, "dmd2.local", salt, self.rank))
        self.shared.manual_seed(stream_seed(self.seed, "dmd2.shared", salt))
