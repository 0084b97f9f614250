"""Adapters for diffusers' transformers: SD3/SD3.5, Flux, Qwen-Image, Wan, and class-conditional DiT.

Conditioning is precomputed (text encoders stay outside the training loop):
`cond` holds prompt embeddings and, where the family uses them, pooled
embeddings. Every family predicts the flow-matching velocity `eps - x0`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from diffusers import (
    DiTTransformer2DModel,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from torch import nn

from verl_dmd.adapters.base import DistributionMatchingModelAdapter, ModelSource
from verl_dmd.adapters.registry import register_adapter


def _randn(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


@register_adapter("sd3")
class SD3Adapter(DistributionMatchingModelAdapter):
    """SD3 / SD3.5 MMDiT: latents (B, C, H, W); timestep = 1000 * sigma."""

    model_class = SD3Transformer2DModel
    tiny_config: ClassVar[dict] = {
        "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "caption_projection_dim": 16,
        "pooled_projection_dim": 8, "out_channels": 4, "pos_embed_max_size": 16,
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.transformer_blocks)

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        return model(
            hidden_states=x_t,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            timestep=sigma * 1000.0,
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, cfg.in_channels, cfg.sample_size, cfg.sample_size), generator)
        cond = {
            "encoder_hidden_states": _randn((batch_size, 4, cfg.joint_attention_dim), generator),
            "pooled_projections": _randn((batch_size, cfg.pooled_projection_dim), generator),
        }
        return x0, cond


@register_adapter("flux")
class FluxAdapter(DistributionMatchingModelAdapter):
    """Flux: packed latent tokens (B, N, C) on a square grid; timestep = sigma.

    Position ids are derived from the token grid here, so `cond` holds only
    per-sample tensors (micro-batching splits every entry along dim 0).
    """

    model_class = FluxTransformer2DModel
    tiny_config: ClassVar[dict] = {
        "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
        "axes_dims_rope": [2, 2, 4],
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return [*model.transformer_blocks, *model.single_transformer_blocks]

    @staticmethod
    def _ids(num_tokens: int, num_text: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        side = math.isqrt(num_tokens)
        if side * side != num_tokens:
            raise ValueError(f"flux adapter: {num_tokens} latent tokens do not form a square grid")
        rows = torch.arange(side, device=like.device).repeat_interleave(side)
        cols = torch.arange(side, device=like.device).repeat(side)
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(like.dtype)
        txt_ids = torch.zeros(num_text, 3, device=like.device, dtype=like.dtype)
        return img_ids, txt_ids

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        text = cond["encoder_hidden_states"]
        img_ids, txt_ids = self._ids(x_t.shape[1], text.shape[1], x_t)
        return model(
            hidden_states=x_t,
            encoder_hidden_states=text,
            pooled_projections=cond["pooled_projections"],
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=cond.get("guidance"),
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, 16, cfg.in_channels), generator)
        cond = {
            "encoder_hidden_states": _randn((batch_size, 4, cfg.joint_attention_dim), generator),
            "pooled_projections": _randn((batch_size, cfg.pooled_projection_dim), generator),
        }
        return x0, cond


@register_adapter("qwen_image")
class QwenImageAdapter(DistributionMatchingModelAdapter):
    """Qwen-Image MMDiT: packed latent tokens (B, N, C) on a square grid; timestep = sigma.

    The image grid (`img_shapes`) is derived from the token count; the text mask
    ``cond["encoder_hidden_states_mask"]`` (B, L) is optional (all tokens valid).
    """

    model_class = QwenImageTransformer2DModel
    tiny_config: ClassVar[dict] = {
        "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "axes_dims_rope": [2, 2, 4],
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.transformer_blocks)

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        batch, tokens = x_t.shape[:2]
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ValueError(f"qwen_image adapter: {tokens} latent tokens do not form a square grid")
        text = cond["encoder_hidden_states"]
        mask = cond.get("encoder_hidden_states_mask")
        if mask is None:
            mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
        return model(
            hidden_states=x_t,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            timestep=sigma,
            img_shapes=[[(1, side, side)]] * batch,
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, 16, cfg.in_channels), generator)
        cond = {"encoder_hidden_states": _randn((batch_size, 4, cfg.joint_attention_dim), generator)}
        return x0, cond


@register_adapter("wan")
class WanAdapter(DistributionMatchingModelAdapter):
    """Wan 2.x video DiT: latents (B, C, F, H, W); timestep = 1000 * sigma."""

    model_class = WanTransformer3DModel
    tiny_config: ClassVar[dict] = {
        "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 16, "num_layers": 2, "rope_max_seq_len": 32,
    }  # fmt: skip

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.blocks)

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        return model(
            hidden_states=x_t,
            timestep=sigma * 1000.0,
            encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
        )[0]

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, cfg.in_channels, 2, 8, 8), generator)
        cond = {"encoder_hidden_states": _randn((batch_size, 4, cfg.text_dim), generator)}
        return x0, cond


def set_label_dropout(model: nn.Module, probability: float) -> None:
    """Set the label-dropout probability of every label embedder of a DiT (each block has its own)."""
    from diffusers.models.embeddings import LabelEmbedding

    embedders = [m for m in model.modules() if isinstance(m, LabelEmbedding)]
    if not embedders:
        raise ValueError(f"{type(model).__name__} has no label embedder: not a class-conditional DiT")
    for embedder in embedders:
        embedder.dropout_prob = probability


@register_adapter("dit")
class DiTAdapter(DistributionMatchingModelAdapter):
    """Class-conditional DiT trained as a flow-matching velocity model: latents (B, C, H, W),
    timestep = 1000 * sigma, ``cond["class_labels"]`` (B,) long; the null class for
    classifier-free guidance is ``num_embeds_ada_norm`` (the extra row of the label table).
    """

    model_class = DiTTransformer2DModel
    tiny_config: ClassVar[dict] = {
        "sample_size": 8, "patch_size": 2, "in_channels": 1, "out_channels": 1, "num_layers": 2,
        "num_attention_heads": 2, "attention_head_dim": 8, "num_embeds_ada_norm": 10,
        "norm_type": "ada_norm_zero",
    }  # fmt: skip

    def build_model(self, source: ModelSource) -> nn.Module:
        """As the base, with DiT's label dropout off: distillation conditions every forward explicitly.

        diffusers' DiT drops 10% of class labels to the null class in train mode, drawing
        from torch's global RNG. In a distillation that would give a trainable role
        unconditional inputs it never asked for and make training depend on the global
        RNG; a script that trains a DiT teacher for CFG re-enables it (see
        scripts/train_digits_teacher.py).
        """
        model = super().build_model(source)
        set_label_dropout(model, 0.0)
        return model

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        # DiT's forward reads transformer_blocks[0].norm1.emb outside block 0; a block sharded as
        # its own unit would then mix plain tensors and DTensors (TRAPS). Block 0 stays in the root.
        return list(model.transformer_blocks)[1:]

    def predict(self, model, x_t, sigma, cond: Mapping[str, torch.Tensor]):
        return model(
            hidden_states=x_t, timestep=sigma * 1000.0, class_labels=cond["class_labels"], return_dict=False
        )[0]

    def null_class(self, model: nn.Module) -> int:
        """The extra row of the label table (``num_embeds_ada_norm``)."""
        return int(model.config.num_embeds_ada_norm)

    def example_batch(self, model, batch_size, generator):
        cfg = model.config
        x0 = _randn((batch_size, cfg.in_channels, cfg.sample_size, cfg.sample_size), generator)
        labels = torch.randint(cfg.num_embeds_ada_norm, (batch_size,), generator=generator)
        return x0, {"class_labels": labels}
