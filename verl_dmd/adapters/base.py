"""The model-adapter contract: what verl_dmd needs to know about one model family."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from verl_dmd import losses

ATTENTION_KERNELS = ("cudnn", "efficient", "flash")
"""The scaled-dot-product-attention kernels torch has a switch for (verl_dmd.runtime.attention switches them)."""


@dataclass(frozen=True)
class ModelSource:
    """Where one model's weights come from: a local directory or a config (random init)."""

    path: str | None = None
    subfolder: str | None = None
    config: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, spec: Any) -> ModelSource:
        """From a plan spec (TeacherSpec / TrainableModelSpec)."""
        return cls(path=spec.path, subfolder=spec.subfolder, config=spec.config)

    @property
    def is_empty(self) -> bool:
        return self.path is None and self.config is None


def plain(value: Any) -> Any:
    """A deep-frozen plan mapping back to plain dicts and lists (what model constructors expect)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


class DistributionMatchingModelAdapter:
    """Knows one model family: building it, sharding it, adapting it, calling it and reading its prediction.

    Subclasses set `model_class` (a diffusers `ModelMixin` with peft support),
    `default_lora_targets`, and implement `fsdp_units`, `predict` and
    `example_batch`; they may override `build_model`. `parameterization` says what
    `predict` returns (velocity, epsilon or x0 under the flow interpolation of
    docs/dmd2.md); every conversion of a prediction (`add_noise`, `to_x0`,
    `prediction_target`, `fake_score_weight`, `ode_step`) goes through the methods
    below, which follow `parameterization`; a family that reads its output another
    way overrides them (all of them together) and every method and sampler follows. The adapter is also where a run's phase computer is
    made (`build_distribution_matching_computer`), from the method `algorithm.name`
    registers (`verl_dmd.algorithms`).
    """

    name: ClassVar[str] = ""
    model_class: ClassVar[type[nn.Module]]
    parameterization: ClassVar[str] = "velocity"
    """What `predict` returns: velocity (eps - x0, the flow families), epsilon or x0."""
    sigma_max: ClassVar[float] = 1.0
    """The highest noise level the family samples from and trains its student from. 1 for velocity and x0
    prediction; an epsilon model has no x0 estimate at 1 (pure noise), so its family sets a level below."""
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    full_precision_inputs: ClassVar[tuple[str, ...]] = ("timestep", "guidance")
    """Keyword inputs of the model that stay float32 under bf16 mixed precision, as the family's pipeline
    hands them to a bf16 transformer (its embeddings compute in float32 and cast after); every other
    floating input is cast to the compute dtype at the model's forward. A timestep of 1000 sigma cast to
    bf16 would move by up to 2 near 1000 (bf16's spacing there is 4)."""
    excluded_attention_kernels: ClassVar[tuple[str, ...]] = ()
    """Scaled-dot-product-attention kernels (of ATTENTION_KERNELS) this family must not run on CUDA: each
    rank switches them off before building its models (torch then picks among the rest)."""
    pipeline_component: ClassVar[str] = "transformer"
    """The model's name in its diffusers pipeline (model_index.json; LoRA keys' prefix)."""
    tiny_config: ClassVar[dict[str, Any]] = {}
    """A config that builds in well under a second on a CPU: for tests, examples and smoke runs."""

    def build_model(self, source: ModelSource) -> nn.Module:
        """Load from a local directory (never downloads) or build from a config (random init).

        Random init draws from torch's global RNG: callers seed it identically on
        every rank so that all ranks hold the same weights.
        """
        if source.path is not None:
            from verl_dmd.assets import resolve_model_path

            path = resolve_model_path(source.path)
            kwargs = {"local_files_only": True, "torch_dtype": torch.float32}
            if source.subfolder:
                kwargs["subfolder"] = source.subfolder
            try:
                model = self.model_class.from_pretrained(path, **kwargs)
            except (OSError, ValueError) as err:
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise ValueError(
                    f"model path {source.path!r} (subfolder {source.subfolder!r}) could not be loaded as "
                    f"{self.model_class.__name__}: {first}; fix: point model.*.path at a local diffusers "
                    "model directory"
                ) from None
        elif source.config is not None:
            try:
                model = self.model_class.from_config(plain(source.config))
            except TypeError as err:
                raise ValueError(
                    f"model config for adapter {self.name!r} was rejected by {self.model_class.__name__}: {err}"
                ) from None
        else:
            raise ValueError("model source has neither a path nor a config")
        return model

    def build_distribution_matching_computer(self, model_config: Any, plan: Any, *, rank: int = 0):
        """The phase computer of `plan.algorithm.name` for this family (a method of `verl_dmd.algorithms`).

        `model_config` is the plan's model section, handed to the method for computers that depend on
        the layout or numerics; the computer's random streams are seeded from `plan.trainer.seed` and
        `rank`. An unknown method name is a one-line error listing the registered ones.
        """
        from verl_dmd.algorithms.registry import get_method

        return get_method(plan.algorithm.name).from_plan(self, model_config, plan, rank=rank)

    # ------------------------------------------------------------------ the parameterization

    def add_noise(self, x0: torch.Tensor, eps: torch.Tensor, sigma) -> torch.Tensor:
        """`x0` noised to level `sigma` (the flow interpolation ``(1 - sigma) x0 + sigma eps``)."""
        return losses.add_noise(x0, eps, sigma)

    def to_x0(self, x_t: torch.Tensor, prediction: torch.Tensor, sigma) -> torch.Tensor:
        """The x0 estimate of a `predict` output at level `sigma`."""
        return losses.x0_from_prediction(self.parameterization, x_t, prediction, sigma)

    def prediction_target(self, x0: torch.Tensor, eps: torch.Tensor, sigma) -> torch.Tensor:
        """What `predict` should return at ``add_noise(x0, eps, sigma)`` (the denoising loss's target)."""
        return losses.prediction_target(self.parameterization, x0, eps)

    def fake_score_weight(self, weighting: str, sigma: torch.Tensor) -> torch.Tensor | None:
        """Per-sample weights of the squared error of `predict` that make the fake-score loss `weighting`
        (docs/dmd2.md; None: unweighted). An adapter that converts its prediction its own way overrides
        this along with `to_x0`."""
        return losses.fake_score_weight(weighting, self.parameterization, sigma)

    def ode_step(self, x_t: torch.Tensor, prediction: torch.Tensor, sigma, next_sigma) -> torch.Tensor:
        """One step of the probability-flow ODE from `sigma` to `next_sigma` (the teacher's sampler)."""
        return losses.ode_step(self.parameterization, x_t, prediction, sigma, next_sigma)

    def null_class(self, model: nn.Module) -> int | None:
        """The class label meaning "no class" (classifier-free guidance of class-conditional families), or
        None for families conditioned otherwise (text embeddings)."""
        return None

    def gan_feature_module(self, model: nn.Module) -> nn.Module:
        """The block whose output the GAN head reads: by default the last FSDP unit."""
        return list(self.fsdp_units(model))[-1]

    def gan_feature_dim(self, model: nn.Module) -> int:
        """Width of those features (the transformer's inner dimension by default)."""
        config = model.config
        return int(config.num_attention_heads * config.attention_head_dim)

    def gan_feature_grid(self, x_t: torch.Tensor, features: torch.Tensor) -> tuple[int, ...] | None:
        """The grid the N image tokens of `features` (B, N, D) lie on, row-major: (rows, cols), or (frames, rows,
        cols); the conv GAN head lays them out on it. By default from the model input `x_t`: packed tokens
        (B, N, C) on a square grid; latents (B, C, H, W) or (B, C, F, H, W) cut into square patches (frames
        not patched). None when that does not account for the N tokens (the head then refuses with one line);
        a family whose blocks read otherwise overrides this."""
        if features.ndim != 3:
            return None
        tokens = int(features.shape[1])
        if x_t.ndim == 3:
            side = math.isqrt(tokens)
            return (side, side) if side * side == tokens else None
        if x_t.ndim not in (4, 5):
            return None
        frames = int(x_t.shape[2]) if x_t.ndim == 5 else 1
        height, width = int(x_t.shape[-2]), int(x_t.shape[-1])
        if tokens % frames:
            return None
        patch = math.isqrt(height * width // (tokens // frames))
        if (
            patch < 1
            or height % patch
            or width % patch
            or frames * (height // patch) * (width // patch) != tokens
        ):
            return None
        grid = (height // patch, width // patch)
        return (frames, *grid) if x_t.ndim == 5 else grid

    def predict_with_features(
        self, model: nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`predict` plus the output of `gan_feature_module` (its last tensor if it returns several:
        the image tokens for SD3, Flux, Wan and DiT blocks), read by a forward hook."""
        captured: list[torch.Tensor] = []

        def keep(module, args, output) -> None:
            outputs = output if isinstance(output, tuple) else (output,)
            captured.append([t for t in outputs if isinstance(t, torch.Tensor)][-1])

        handle = self.gan_feature_module(model).register_forward_hook(keep)
        try:
            prediction = self.predict(model, x_t, sigma, cond)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise RuntimeError(
                f"adapter {self.name!r}: the GAN feature module ran {len(captured)} times in one forward; "
                "override gan_feature_module to name a block that runs once"
            )
        return prediction, captured[0]

    # ------------------------------------------------------------------ the family's diffusers pipeline
    # verl-dmd-prepare and the decoded validation use these; a family without pipeline support keeps the
    # defaults (empty `pipeline_classes`) and both refuse it with one line.

    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    """The diffusers pipeline classes (``_class_name`` of model_index.json) a pipeline directory of this family
    may hold; empty: no pipeline support."""
    text_encoders: ClassVar[tuple[str, ...]] = ()
    """The pipeline components `encode_prompts` runs (text encoders; their tokenizers come along)."""
    max_text_tokens: ClassVar[int | None] = None
    """The most text tokens the pipeline serves (its check_inputs refuses more); None: no limit."""
    ragged_cond: ClassVar[Mapping[str, str]] = {}
    """Conditioning entries of variable length (padded per batch) -> the mask entry that marks real tokens."""

    def encode_prompts(
        self, pipe: Any, prompts: list[str], *, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """`cond` entries of `prompts` through the pipeline's own ``encode_prompt`` at its serving settings."""
        raise NotImplementedError(f"model adapter {self.name!r} does not encode prompts")

    def constant_cond(
        self, transformer_config: Mapping[str, Any], guidance: float | None
    ) -> dict[str, float]:
        """Per-sample conditioning that is the same for every prompt (Flux-dev's guidance embedding)."""
        return {}

    def latent_shape(
        self,
        vae_config: Mapping[str, Any],
        transformer_config: Mapping[str, Any],
        height: int,
        width: int,
        num_frames: int | None,
    ) -> tuple[int, ...]:
        """The shape of one latent as `predict` takes it, for an image (video) of that size; ValueError naming
        `prepare.resolution` (or `prepare.num_frames`) when the pipeline cannot make that size."""
        raise NotImplementedError(f"model adapter {self.name!r} has no latent layout")

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Latents (as `predict` takes them) of pixels in [-1, 1], (B, 3, H, W) or (B, 3, F, H, W) for video:
        the VAE's mean, normalised as the pipeline normalises."""
        raise NotImplementedError(f"model adapter {self.name!r} has no VAE encoding")

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Pixels in [-1, 1] of latents, as the pipeline decodes them: (B, 3, H, W), or (B, 3, F, H, W)."""
        raise NotImplementedError(f"model adapter {self.name!r} has no VAE decoding")

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        """The submodules sharded as their own FSDP2 units (usually the transformer blocks)."""
        raise NotImplementedError

    def predict(
        self, model: nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]
    ):
        """The model's raw prediction at noise level `sigma` (shape (batch,)) with conditioning `cond`."""
        raise NotImplementedError

    def example_batch(
        self, model: nn.Module, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A random (x0, cond) batch of the shapes the model takes (tests, benchmarks, warm-up)."""
        raise NotImplementedError
