"""The model-adapter contract: what verl_dmd needs to know about one model family."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn


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
    """Knows one model family: building it, sharding it, adapting it and calling it.

    Subclasses set `model_class` (a diffusers `ModelMixin` with peft support),
    `default_lora_targets`, and implement `fsdp_units`, `predict` and
    `example_batch`; they may override `build_model` and
    `build_distribution_matching_computer`. `parameterization` says what `predict` returns; the
    losses convert it to x0 through `verl_dmd.losses`.
    """

    name: ClassVar[str] = ""
    model_class: ClassVar[type[nn.Module]]
    parameterization: ClassVar[str] = "velocity"
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
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
        """The phase computer for this family and `plan.algorithm` (DMD2 unless a subclass says otherwise).

        `model_config` is the plan's model spec (`plan.model`), for families whose
        computer depends on it; the computer's random streams are seeded from
        `plan.trainer.seed` and `rank`.
        """
        if plan.algorithm.name != "dmd2":
            raise ValueError(
                f"config key 'algorithm.name' = {plan.algorithm.name!r}: adapter {self.name!r} builds only "
                "'dmd2'; fix: set algorithm.name=dmd2"
            )
        from verl_dmd.algorithms.dmd2 import DMD2Computer

        return DMD2Computer(self, plan.algorithm, seed=plan.trainer.seed, rank=rank)

    def gan_feature_module(self, model: nn.Module) -> nn.Module:
        """The block whose output the GAN head reads: by default the last FSDP unit."""
        return list(self.fsdp_units(model))[-1]

    def gan_feature_dim(self, model: nn.Module) -> int:
        """Width of those features (the transformer's inner dimension by default)."""
        config = model.config
        return int(config.num_attention_heads * config.attention_head_dim)

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
